"""Every environment variable FlashMemory reads, in one place.

The names are upstream's (`SGLANG_DECODE_SWAP_P`, `SGLANG_PATHP_*`, `SGLANG_RETRIEVER_*`) so that
existing launch scripts keep working. Upstream's debug and "fix" gates are gone: their fixes are
the plain behaviour here. Read the environment once with `FlashMemoryEnv.from_environ()`; no other
module calls `os.environ` for a gate.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping


class EnvError(ValueError):
    """A FlashMemory environment variable holds a value that cannot be used."""


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}={raw!r}: expected 0/1 (or true/false)")


def _int(env: Mapping[str, str], name: str, default: int, lo: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected an integer") from None
    if v < lo:
        raise EnvError(f"{name}={v}: must be >= {lo}")
    return v


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = float(raw.strip())
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected a number") from None
    if not (lo <= v <= hi) or math.isnan(v):
        raise EnvError(f"{name}={v}: must lie in [{lo}, {hi}]")
    return v


def parse_layers(raw: str, name: str = "SGLANG_RETRIEVER_INLINE_LAYERS", n_c4_layers: int = 21) -> tuple[int, ...]:
    """Parse '10,12,20' into sorted unique c4-layer ids, each in [0, n_c4_layers)."""
    try:
        ids = sorted({int(p) for p in raw.replace(" ", "").split(",") if p != ""})
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected comma-separated c4 layer ids like 10,12,20") from None
    if not ids:
        raise EnvError(f"{name}={raw!r}: names no layer")
    bad = [i for i in ids if not 0 <= i < n_c4_layers]
    if bad:
        raise EnvError(f"{name}={raw!r}: layer ids {bad} outside [0, {n_c4_layers}) (ids count c4 layers, not model layers)")
    return tuple(ids)


CPU_GATE = "SGLANG_FLASHMEMORY_CPU"


def cpu_enabled(env: Mapping[str, str] | None = None) -> bool:
    """SGLANG_FLASHMEMORY_CPU: the CPU execution layer for sglang's DeepSeek-V4 path (`flashmemory.sglang.cpu`).

    Read on its own because sglang's platform discovery asks for it in every process, before anything else."""
    return _bool(os.environ if env is None else env, CPU_GATE, False)


@dataclass(frozen=True)
class FlashMemoryEnv:
    """The resolved gates and knobs; defaults match upstream `launch_decode.sh` where that still makes sense."""

    # Gates (all off = stock sglang).
    decode_swap_p: bool = False          # SGLANG_DECODE_SWAP_P: Path-P, c4 KV in a host mirror + device reserve
    index_k_offload: bool = False        # SGLANG_PATHP_INDEX_K_OFFLOAD: Path-I, non-target index-K offloaded too
    score_resident: bool = False         # SGLANG_PATHP_SCORE_RESIDENT: Level 2 scores only resident pages
    page_recall: bool = False            # SGLANG_PATHP_PAGE_RECALL: page-granular recall (the only mode here)
    cudagraph: bool = False              # SGLANG_PATHP_CUDAGRAPH: Level 2 inside the decode CUDA graph
    async_recall: bool = True            # SGLANG_PATHP_ASYNC_RECALL: Level 1 on a worker thread + side stream
    fused_remap: bool = False            # SGLANG_PATHP_FUSED_REMAP: top-k columns map straight to reserve cells
    stagger_cycle: bool = False          # SGLANG_PATHP_STAGGER_CYCLE: spread requests over the tau phases
    dump_mode: bool = False              # SGLANG_FLASHMEMORY_DUMP: per-request golden-label dump (data generation)
    cpu: bool = False                    # SGLANG_FLASHMEMORY_CPU: run sglang's DeepSeek-V4 path on CPU (no GPU)
    # Page budget.
    page_kmax: int = 96                  # SGLANG_PATHP_PAGE_KMAX: resident pages per request
    page_kmax_ratio: float = 0.0         # SGLANG_PATHP_PAGE_KMAX_RATIO: if > 0, KMAX = ceil(ratio * pages(TGT_CTX))
    target_context: int = 262144         # SGLANG_DSV4_TARGET_CONTEXT: tokens, used with the ratio
    # Level 1 retriever.
    retriever_ckpt: str = ""             # SGLANG_RETRIEVER_INLINE_CKPT: "" = Level 1 off (everything resident)
    retriever_layers: tuple[int, ...] = (10, 12, 20)  # SGLANG_RETRIEVER_INLINE_LAYERS (c4-layer ids)
    interval: int = 64                   # SGLANG_RETRIEVER_INTERVAL: tau, decode steps per Level-1 cycle
    threshold: float = 0.5               # SGLANG_RETRIEVER_SIGMOID_THRESH: keep if score > threshold
    last_keep: int = 2048                # SGLANG_RETRIEVER_LAST_KEEP: recency tail, in c4 chunks
    first_keep: int = 0                  # SGLANG_RETRIEVER_FIRST_KEEP: sink, in c4 chunks
    ensemble_mode: str = "or"            # SGLANG_RETRIEVER_ENSEMBLE_MODE: "or" (max) | "mean"
    max_resident: int = 0                # SGLANG_RETRIEVER_MAX_RESIDENT: chunk cap, 0 = none
    max_position: int = 1048576          # SGLANG_RETRIEVER_MAX_POSITION: RoPE table length
    logit_offset: float = 0.0            # SGLANG_RETRIEVER_LOGIT_OFFSET
    # Reserve sizing.
    reserve_pages: int = 0               # SGLANG_PATHP_RESERVE_PAGES: page blocks per layer, 0 = auto
    decode_resident_chunks: int = 512    # SGLANG_PATHP_DECODE_RESIDENT_CHUNKS: per-request decode region
    decode_max_conc: int = 128           # SGLANG_PATHP_DECODE_MAX_CONC: rows with a decode region
    target_concurrency: int = 64         # SGLANG_DSV4_TARGET_CONCURRENCY: used by auto reserve sizing
    # PD decode ("B mode"): where the c4 KV lives.
    pd_c4_shrink: bool = True            # SGLANG_PD_B_C4_SHRINK: PD lands c4 KV in the mirror, device pool -> reserve
    pd_credit_c4: bool = False           # SGLANG_PD_CREDIT_OFFLOADED_C4: size the token pool without the c4 KV term

    @property
    def any_gate(self) -> bool:
        return self.decode_swap_p or self.index_k_offload or self.score_resident or self.dump_mode

    @property
    def level1_enabled(self) -> bool:
        return self.decode_swap_p and bool(self.retriever_ckpt)

    def kmax(self, page_chunks: int = 64, ratio: int = 4) -> int:
        """Resident pages per request: `PAGE_KMAX`, or derived from `PAGE_KMAX_RATIO` x target context."""
        if self.page_kmax_ratio > 0:
            pages = math.ceil(math.ceil(self.target_context / ratio) / page_chunks)
            return max(1, math.ceil(self.page_kmax_ratio * pages))
        return self.page_kmax

    def auto_reserve_pages(self) -> int:
        """Recall blocks per layer: KMAX per concurrent request plus one spare page each (counted in pages, not tokens)."""
        if self.reserve_pages > 0:
            return self.reserve_pages
        return self.target_concurrency * (self.kmax() + 1)

    def active_features(self) -> list[str]:
        names = {
            "decode_swap_p": "path-p", "index_k_offload": "path-i", "score_resident": "score-resident",
            "cudagraph": "cuda-graph", "dump_mode": "dump",
        }
        feats = [label for attr, label in names.items() if getattr(self, attr)]
        if self.level1_enabled:
            feats.append(f"level1(layers={','.join(map(str, self.retriever_layers))},tau={self.interval})")
        return feats

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "FlashMemoryEnv":
        e = os.environ if env is None else env
        d = cls()
        mode = (e.get("SGLANG_RETRIEVER_ENSEMBLE_MODE") or d.ensemble_mode).strip().lower()
        if mode not in ("or", "max", "mean"):
            raise EnvError(f"SGLANG_RETRIEVER_ENSEMBLE_MODE={mode!r}: expected 'or' (max) or 'mean'")
        return cls(
            decode_swap_p=_bool(e, "SGLANG_DECODE_SWAP_P", d.decode_swap_p),
            index_k_offload=_bool(e, "SGLANG_PATHP_INDEX_K_OFFLOAD", d.index_k_offload),
            score_resident=_bool(e, "SGLANG_PATHP_SCORE_RESIDENT", d.score_resident),
            page_recall=_bool(e, "SGLANG_PATHP_PAGE_RECALL", d.page_recall),
            cudagraph=_bool(e, "SGLANG_PATHP_CUDAGRAPH", d.cudagraph),
            async_recall=_bool(e, "SGLANG_PATHP_ASYNC_RECALL", d.async_recall),
            fused_remap=_bool(e, "SGLANG_PATHP_FUSED_REMAP", d.fused_remap),
            stagger_cycle=_bool(e, "SGLANG_PATHP_STAGGER_CYCLE", d.stagger_cycle),
            dump_mode=_bool(e, "SGLANG_FLASHMEMORY_DUMP", d.dump_mode),
            cpu=cpu_enabled(e),
            page_kmax=_int(e, "SGLANG_PATHP_PAGE_KMAX", d.page_kmax, lo=1),
            page_kmax_ratio=_float(e, "SGLANG_PATHP_PAGE_KMAX_RATIO", d.page_kmax_ratio, 0.0, 1.0),
            target_context=_int(e, "SGLANG_DSV4_TARGET_CONTEXT", d.target_context, lo=1),
            retriever_ckpt=(e.get("SGLANG_RETRIEVER_INLINE_CKPT") or "").strip(),
            retriever_layers=parse_layers(e.get("SGLANG_RETRIEVER_INLINE_LAYERS") or "10,12,20"),
            interval=_int(e, "SGLANG_RETRIEVER_INTERVAL", d.interval, lo=1),
            threshold=_float(e, "SGLANG_RETRIEVER_SIGMOID_THRESH", d.threshold, 0.0, 1.0),
            last_keep=_int(e, "SGLANG_RETRIEVER_LAST_KEEP", d.last_keep),
            first_keep=_int(e, "SGLANG_RETRIEVER_FIRST_KEEP", d.first_keep),
            ensemble_mode="or" if mode in ("or", "max") else "mean",
            max_resident=_int(e, "SGLANG_RETRIEVER_MAX_RESIDENT", d.max_resident),
            max_position=_int(e, "SGLANG_RETRIEVER_MAX_POSITION", d.max_position, lo=1),
            logit_offset=_float(e, "SGLANG_RETRIEVER_LOGIT_OFFSET", d.logit_offset, -1e4, 1e4),
            reserve_pages=_int(e, "SGLANG_PATHP_RESERVE_PAGES", d.reserve_pages),
            decode_resident_chunks=_int(e, "SGLANG_PATHP_DECODE_RESIDENT_CHUNKS", d.decode_resident_chunks, lo=1),
            decode_max_conc=_int(e, "SGLANG_PATHP_DECODE_MAX_CONC", d.decode_max_conc, lo=1),
            target_concurrency=_int(e, "SGLANG_DSV4_TARGET_CONCURRENCY", d.target_concurrency, lo=1),
            pd_c4_shrink=_bool(e, "SGLANG_PD_B_C4_SHRINK", d.pd_c4_shrink),
            pd_credit_c4=_bool(e, "SGLANG_PD_CREDIT_OFFLOADED_C4", d.pd_credit_c4),
        )


# name -> (default as a string, one-line meaning); the README table and `flashmemory env` print this.
ENV_DOC: dict[str, tuple[str, str]] = {
    "SGLANG_DECODE_SWAP_P": ("0", "Path-P: c4 KV lives in a host mirror; resident pages are recalled into a device reserve"),
    "SGLANG_PATHP_INDEX_K_OFFLOAD": ("0", "Path-I: index-K of the non-target c4 layers is offloaded the same way"),
    "SGLANG_PATHP_SCORE_RESIDENT": ("0", "Level 2 scores only the resident pages (otherwise: mask mode over the full history)"),
    "SGLANG_PATHP_PAGE_RECALL": ("0", "Accepted for compatibility; recall is always page-granular here"),
    "SGLANG_PATHP_CUDAGRAPH": ("0", "Allocate Level-2 buffers before capture so Level 2 runs inside the decode CUDA graph"),
    "SGLANG_PATHP_ASYNC_RECALL": ("1", "Run the Level-1 cycle on a worker thread (and a side CUDA stream when present)"),
    "SGLANG_PATHP_FUSED_REMAP": ("0", "Score-resident top-k columns map straight to reserve cells"),
    "SGLANG_PATHP_STAGGER_CYCLE": ("0", "Give each request its own phase within the tau window"),
    "SGLANG_PATHP_PAGE_KMAX": ("96", "Resident pages (64 chunks each) per request"),
    "SGLANG_PATHP_PAGE_KMAX_RATIO": ("0", "If > 0: KMAX = ceil(ratio * pages of SGLANG_DSV4_TARGET_CONTEXT)"),
    "SGLANG_DSV4_TARGET_CONTEXT": ("262144", "Target context in tokens, for the KMAX ratio"),
    "SGLANG_DSV4_TARGET_CONCURRENCY": ("64", "Target concurrency, for auto reserve sizing"),
    "SGLANG_PATHP_RESERVE_PAGES": ("0", "Recall page blocks per layer; 0 = TARGET_CONCURRENCY * (KMAX + 1)"),
    "SGLANG_PATHP_DECODE_RESIDENT_CHUNKS": ("512", "Per-request decode region, in chunks (decode-time c4 entries)"),
    "SGLANG_PATHP_DECODE_MAX_CONC": ("128", "Number of decode regions (max concurrent requests)"),
    "SGLANG_PD_B_C4_SHRINK": ("1", "With Path-P on a PD decode server (nixl): PD lands c4 KV in the host mirror and "
                              "the device c4 KV pool becomes the reserve (otherwise copy mode: no device memory saved)"),
    "SGLANG_PD_CREDIT_OFFLOADED_C4": ("0", "With the shrink active: size sglang's token pool without the c4 KV bytes "
                                      "(more tokens; the reserve then comes out of the non-static headroom)"),
    "SGLANG_RETRIEVER_INLINE_CKPT": ("", "Retriever checkpoint (.safetensors or .pt); empty = Level 1 off"),
    "SGLANG_RETRIEVER_INLINE_LAYERS": ("10,12,20", "Target layers, as ids among the 21 c4 layers"),
    "SGLANG_RETRIEVER_INTERVAL": ("64", "tau: decode steps between Level-1 cycles"),
    "SGLANG_RETRIEVER_SIGMOID_THRESH": ("0.5", "A chunk passes if its ensemble score is strictly above this"),
    "SGLANG_RETRIEVER_LAST_KEEP": ("2048", "Recency tail, in c4 chunks (4 tokens each)"),
    "SGLANG_RETRIEVER_FIRST_KEEP": ("0", "Sink, in c4 chunks"),
    "SGLANG_RETRIEVER_ENSEMBLE_MODE": ("or", "'or' = max over layers, 'mean' = average"),
    "SGLANG_RETRIEVER_MAX_RESIDENT": ("0", "Cap on resident chunks per request; 0 = none"),
    "SGLANG_RETRIEVER_MAX_POSITION": ("1048576", "Retriever RoPE table length; positions beyond it are clamped"),
    "SGLANG_RETRIEVER_LOGIT_OFFSET": ("0.0", "Added to the retriever logit before the sigmoid"),
    "SGLANG_FLASHMEMORY_DUMP": ("0", "Dump mode for data generation (per request, via custom_params)"),
    "SGLANG_FLASHMEMORY_CPU": ("0", "Run sglang's DeepSeek-V4 path on CPU: torch fallbacks for the CUDA-only kernels "
                               "(with --device cpu; independent of the FlashMemory gates)"),
}
