"""Every environment variable FlashMemory reads, in one place: this module and its parts beside it.

The names are upstream's (`SGLANG_DECODE_SWAP_P`, `SGLANG_PATHP_*`, `SGLANG_RETRIEVER_*`) so that
existing launch scripts keep working. Upstream's debug and "fix" gates are gone: their fixes are
the plain behaviour here. Read the environment once with `FlashMemoryEnv.from_environ()`; no other
module calls `os.environ` for a gate.

Here: `FlashMemoryEnv`, the gates and knobs of the serving plugin, and `set_defaults`. Beside it, by concept (their
names are importable from here too): `env_values` (`EnvError`, the typed readers, the bounds), `env_disk` (the disk
tier's `DiskTierConfig`), `env_cpu` (the CPU layer's gate and tiny-model geometry), `env_diagnostics` (diagnostic
and test-only variables). `env_doc` says what each variable means; `env_check` is the launch scripts' check.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from flashmemory.env_cpu import (
    CPU_GATE,
    SGLANG_DSV4_PAGE,
    SGLANG_SWA_WINDOW,
    SWA_WINDOW_VAR,
    THREADS_BIND,
    CpuTinyGeometry,
    cpu_enabled,
    cpu_threads_bind_set,
    cpu_tiny_geometry,
)
from flashmemory.env_diagnostics import (
    FAULT_INJECT,
    HISPARSE_TRACE,
    LEVEL1_DELAY,
    STATS_FILE,
    DelaySpec,
    FaultSpec,
    fault_inject,
    hisparse_trace,
    level1_delay,
    stats_file,
)
from flashmemory.env_disk import MAX_DISK_GB, MAX_HOST_CACHE_GB, DiskTierConfig
from flashmemory.env_values import (
    INT_MAX,
    MAX_BLOCKS,
    MAX_PAGES,
    MAX_POSITION,
    MAX_ROWS,
    EnvError,
    parse_layers,
    read_bool,
    read_float,
    read_int,
)

__all__ = [
    "CPU_GATE",
    "FAULT_INJECT",
    "HISPARSE_TRACE",
    "INT_MAX",
    "LEVEL1_DELAY",
    "MAX_BLOCKS",
    "MAX_DISK_GB",
    "MAX_HOST_CACHE_GB",
    "MAX_PAGES",
    "MAX_POSITION",
    "MAX_ROWS",
    "SGLANG_DSV4_PAGE",
    "SGLANG_SWA_WINDOW",
    "STATS_FILE",
    "SWA_WINDOW_VAR",
    "THREADS_BIND",
    "CpuTinyGeometry",
    "DelaySpec",
    "DiskTierConfig",
    "EnvError",
    "FaultSpec",
    "FlashMemoryEnv",
    "cpu_enabled",
    "cpu_threads_bind_set",
    "cpu_tiny_geometry",
    "fault_inject",
    "hisparse_trace",
    "level1_delay",
    "parse_layers",
    "read_bool",
    "read_float",
    "read_int",
    "set_defaults",
    "stats_file",
]


def set_defaults(values: Mapping[str, str], env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each variable of `values` that is not set yet (in `env`, default the process environment, which sglang
    reads); returns {name: value} for those already set to something else (the user's choice wins)."""
    e = os.environ if env is None else env
    differ = {}
    for k, v in values.items():
        cur = e.setdefault(k, v)
        if cur != v:
            differ[k] = cur
    return differ


@dataclass(frozen=True)
class FlashMemoryEnv:
    """The resolved gates and knobs; defaults match upstream `launch_decode.sh` where that still makes sense."""

    # Gates (all off = stock sglang).
    decode_swap_p: bool = False  # SGLANG_DECODE_SWAP_P: Path-P, c4 KV in a host mirror + device reserve
    index_k_offload: bool = False  # SGLANG_PATHP_INDEX_K_OFFLOAD: Path-I, non-target index-K offloaded too
    score_resident: bool = False  # SGLANG_PATHP_SCORE_RESIDENT: Level 2 scores only resident pages
    page_recall: bool = False  # SGLANG_PATHP_PAGE_RECALL: page-granular recall (the only mode here)
    cudagraph: bool = False  # SGLANG_PATHP_CUDAGRAPH: Level 2 inside the decode CUDA graph
    async_recall: bool = True  # SGLANG_PATHP_ASYNC_RECALL: Level 1 on a worker thread + side stream
    fused_remap: bool = False  # SGLANG_PATHP_FUSED_REMAP: top-k columns map straight to reserve cells
    stagger_cycle: bool = False  # SGLANG_PATHP_STAGGER_CYCLE: spread requests over the tau phases
    dump_mode: bool = False  # SGLANG_FLASHMEMORY_DUMP: per-request golden-label dump (data generation)
    dump_root: str = ""  # SGLANG_FLASHMEMORY_DUMP_ROOT: the only tree dump mode writes under (absolute)
    cpu: bool = False  # SGLANG_FLASHMEMORY_CPU: run sglang's DeepSeek-V4 path on CPU (no GPU)
    hisparse_prefetch: bool = False  # SGLANG_FLASHMEMORY_HISPARSE_PREFETCH: hints prefetched into HiSparse's buffer
    hisparse_prefetch_width: int = 64  # SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH: positions per request per step
    hisparse_prefetch_budget: int = 0  # SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_BUDGET: per request per cycle, 0 = H-K
    # Page budget.
    page_kmax: int = 96  # SGLANG_PATHP_PAGE_KMAX: resident pages per request
    page_kmax_ratio: float = 0.0  # SGLANG_PATHP_PAGE_KMAX_RATIO: if > 0, KMAX = ceil(ratio * pages(TGT_CTX))
    target_context: int = 262144  # SGLANG_DSV4_TARGET_CONTEXT: tokens, used with the ratio
    # Level 1 retriever.
    retriever_ckpt: str = ""  # SGLANG_RETRIEVER_INLINE_CKPT: "" = Level 1 off (everything resident)
    retriever_layers: tuple[int, ...] = (10, 12, 20)  # SGLANG_RETRIEVER_INLINE_LAYERS (c4-layer ids)
    interval: int = 64  # SGLANG_RETRIEVER_INTERVAL: tau, decode steps per Level-1 cycle
    threshold: float = 0.5  # SGLANG_RETRIEVER_SIGMOID_THRESH: keep if score > threshold
    last_keep: int = 2048  # SGLANG_RETRIEVER_LAST_KEEP: recency tail, in c4 chunks
    first_keep: int = 0  # SGLANG_RETRIEVER_FIRST_KEEP: sink, in c4 chunks
    ensemble_mode: str = "or"  # SGLANG_RETRIEVER_ENSEMBLE_MODE: "or" (max) | "mean"
    page_policy: str = "fill"  # SGLANG_RETRIEVER_PAGE_POLICY: "fill" (spend KMAX) | "threshold" (passing pages only)
    max_resident: int = 0  # SGLANG_RETRIEVER_MAX_RESIDENT: chunk cap, 0 = none
    max_position: int = 1048576  # SGLANG_RETRIEVER_MAX_POSITION: RoPE table length
    logit_offset: float = 0.0  # SGLANG_RETRIEVER_LOGIT_OFFSET
    # Miss monitor, escalation and exact-recall fallback (flashmemory.residency.escalation).
    miss_monitor: bool = False  # SGLANG_RETRIEVER_MISS_MONITOR: measure each request's miss mass per cycle
    miss_threshold: float = 0.2  # SGLANG_RETRIEVER_MISS_THRESHOLD: escalate above this miss mass
    miss_low: float = 0.05  # SGLANG_RETRIEVER_MISS_LOW: shrink back / leave fallback at or below this
    miss_kmax_cap: int = 0  # SGLANG_RETRIEVER_MISS_KMAX_CAP: most pages per request, 0 = 2 x KMAX
    miss_extra_pages: int = 0  # SGLANG_RETRIEVER_MISS_EXTRA_PAGES: pages above KMAX, all requests; 0 = auto
    miss_shrink_after: int = 2  # SGLANG_RETRIEVER_MISS_SHRINK_AFTER: low cycles before a step back
    miss_fallback_after: int = 2  # SGLANG_RETRIEVER_MISS_FALLBACK_AFTER: high cycles before the fallback
    # Reserve sizing.
    reserve_pages: int = 0  # SGLANG_PATHP_RESERVE_PAGES: page blocks per layer, 0 = auto
    decode_resident_chunks: int = 512  # SGLANG_PATHP_DECODE_RESIDENT_CHUNKS: per-request decode region
    decode_max_conc: int = 128  # SGLANG_PATHP_DECODE_MAX_CONC: rows with a decode region
    target_concurrency: int = 64  # SGLANG_DSV4_TARGET_CONCURRENCY: used by auto reserve sizing
    # PD decode ("B mode"): where the c4 KV lives.
    pd_c4_shrink: bool = True  # SGLANG_PD_B_C4_SHRINK: PD lands c4 KV in the mirror, device pool -> reserve
    pd_credit_c4: bool = False  # SGLANG_PD_CREDIT_OFFLOADED_C4: size the token pool without the c4 KV term
    # Disk tier below the host mirror: SGLANG_PATHP_DISK_DIR / _DISK_GB / _HOST_CACHE_GB.
    disk: DiskTierConfig = DiskTierConfig()

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

    def miss_kmax_cap_pages(self, base: int | None = None) -> int:
        """Pages a request may be widened to by escalation (KMAX when the monitor is off)."""
        base = self.kmax() if base is None else base
        if not self.miss_monitor:
            return base
        return max(base, self.miss_kmax_cap or 2 * base)

    def auto_reserve_pages(self) -> int:
        """Recall blocks per layer: KMAX per concurrent request plus one spare page each (counted in pages, not
        tokens)."""
        if self.reserve_pages > 0:
            return self.reserve_pages
        return self.target_concurrency * (self.kmax() + 1)

    def active_features(self) -> list[str]:
        names = {
            "decode_swap_p": "path-p",
            "index_k_offload": "path-i",
            "score_resident": "score-resident",
            "cudagraph": "cuda-graph",
            "dump_mode": "dump",
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
        page_policy = (e.get("SGLANG_RETRIEVER_PAGE_POLICY") or d.page_policy).strip().lower()
        if page_policy not in ("fill", "threshold"):
            raise EnvError(f"SGLANG_RETRIEVER_PAGE_POLICY={page_policy!r}: expected 'fill' or 'threshold'")
        out = cls(
            decode_swap_p=read_bool(e, "SGLANG_DECODE_SWAP_P", d.decode_swap_p),
            index_k_offload=read_bool(e, "SGLANG_PATHP_INDEX_K_OFFLOAD", d.index_k_offload),
            score_resident=read_bool(e, "SGLANG_PATHP_SCORE_RESIDENT", d.score_resident),
            page_recall=read_bool(e, "SGLANG_PATHP_PAGE_RECALL", d.page_recall),
            cudagraph=read_bool(e, "SGLANG_PATHP_CUDAGRAPH", d.cudagraph),
            async_recall=read_bool(e, "SGLANG_PATHP_ASYNC_RECALL", d.async_recall),
            fused_remap=read_bool(e, "SGLANG_PATHP_FUSED_REMAP", d.fused_remap),
            stagger_cycle=read_bool(e, "SGLANG_PATHP_STAGGER_CYCLE", d.stagger_cycle),
            dump_mode=read_bool(e, "SGLANG_FLASHMEMORY_DUMP", d.dump_mode),
            dump_root=(e.get("SGLANG_FLASHMEMORY_DUMP_ROOT") or "").strip(),
            cpu=cpu_enabled(e),
            hisparse_prefetch=read_bool(e, "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH", d.hisparse_prefetch),
            hisparse_prefetch_width=read_int(
                e, "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH", d.hisparse_prefetch_width, lo=1, hi=MAX_POSITION // 4
            ),
            hisparse_prefetch_budget=read_int(
                e, "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_BUDGET", d.hisparse_prefetch_budget, hi=MAX_POSITION // 4
            ),
            page_kmax=read_int(e, "SGLANG_PATHP_PAGE_KMAX", d.page_kmax, lo=1, hi=MAX_PAGES),
            page_kmax_ratio=read_float(e, "SGLANG_PATHP_PAGE_KMAX_RATIO", d.page_kmax_ratio, 0.0, 1.0),
            target_context=read_int(e, "SGLANG_DSV4_TARGET_CONTEXT", d.target_context, lo=1, hi=MAX_POSITION),
            retriever_ckpt=(e.get("SGLANG_RETRIEVER_INLINE_CKPT") or "").strip(),
            retriever_layers=parse_layers(e.get("SGLANG_RETRIEVER_INLINE_LAYERS") or "10,12,20"),
            interval=read_int(e, "SGLANG_RETRIEVER_INTERVAL", d.interval, lo=1, hi=1 << 20),
            threshold=read_float(e, "SGLANG_RETRIEVER_SIGMOID_THRESH", d.threshold, 0.0, 1.0),
            last_keep=read_int(e, "SGLANG_RETRIEVER_LAST_KEEP", d.last_keep),
            first_keep=read_int(e, "SGLANG_RETRIEVER_FIRST_KEEP", d.first_keep),
            ensemble_mode="or" if mode in ("or", "max") else "mean",
            page_policy=page_policy,
            max_resident=read_int(e, "SGLANG_RETRIEVER_MAX_RESIDENT", d.max_resident),
            max_position=read_int(e, "SGLANG_RETRIEVER_MAX_POSITION", d.max_position, lo=1, hi=MAX_POSITION),
            logit_offset=read_float(e, "SGLANG_RETRIEVER_LOGIT_OFFSET", d.logit_offset, -1e4, 1e4),
            miss_monitor=read_bool(e, "SGLANG_RETRIEVER_MISS_MONITOR", d.miss_monitor),
            miss_threshold=read_float(e, "SGLANG_RETRIEVER_MISS_THRESHOLD", d.miss_threshold, 0.0, 1.0),
            miss_low=read_float(e, "SGLANG_RETRIEVER_MISS_LOW", d.miss_low, 0.0, 1.0),
            miss_kmax_cap=read_int(e, "SGLANG_RETRIEVER_MISS_KMAX_CAP", d.miss_kmax_cap, hi=MAX_PAGES),
            miss_extra_pages=read_int(e, "SGLANG_RETRIEVER_MISS_EXTRA_PAGES", d.miss_extra_pages, hi=MAX_BLOCKS),
            miss_shrink_after=read_int(e, "SGLANG_RETRIEVER_MISS_SHRINK_AFTER", d.miss_shrink_after, lo=1),
            miss_fallback_after=read_int(e, "SGLANG_RETRIEVER_MISS_FALLBACK_AFTER", d.miss_fallback_after, lo=1),
            reserve_pages=read_int(e, "SGLANG_PATHP_RESERVE_PAGES", d.reserve_pages, hi=MAX_BLOCKS),
            decode_resident_chunks=read_int(
                e, "SGLANG_PATHP_DECODE_RESIDENT_CHUNKS", d.decode_resident_chunks, lo=1, hi=MAX_POSITION // 4
            ),
            decode_max_conc=read_int(e, "SGLANG_PATHP_DECODE_MAX_CONC", d.decode_max_conc, lo=1, hi=MAX_ROWS),
            target_concurrency=read_int(e, "SGLANG_DSV4_TARGET_CONCURRENCY", d.target_concurrency, lo=1, hi=MAX_ROWS),
            pd_c4_shrink=read_bool(e, "SGLANG_PD_B_C4_SHRINK", d.pd_c4_shrink),
            pd_credit_c4=read_bool(e, "SGLANG_PD_CREDIT_OFFLOADED_C4", d.pd_credit_c4),
            disk=DiskTierConfig.from_environ(e),
        )
        pages = math.ceil(out.max_position / (4 * 64))
        if out.page_kmax > pages:
            raise EnvError(
                f"SGLANG_PATHP_PAGE_KMAX={out.page_kmax}: more pages than a request of "
                f"SGLANG_RETRIEVER_MAX_POSITION={out.max_position} tokens has "
                f"({pages} pages of 64 c4 chunks)"
            )
        if out.dump_root and not os.path.isabs(out.dump_root):
            raise EnvError(f"SGLANG_FLASHMEMORY_DUMP_ROOT={out.dump_root!r}: must be an absolute directory")
        if out.miss_low > out.miss_threshold:
            raise EnvError(
                f"SGLANG_RETRIEVER_MISS_LOW={out.miss_low} is above SGLANG_RETRIEVER_MISS_THRESHOLD="
                f"{out.miss_threshold}: the shrink-back level must be at or below the escalation level"
            )
        if out.disk.enabled and out.hisparse_prefetch:
            raise EnvError(
                f"SGLANG_PATHP_DISK_DIR={out.disk.dir!r} with SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1: the disk tier "
                "sits under Path-P's host mirror, and the prefetch mode runs without Path-P (sglang's HiSparse "
                "keeps the host copy); unset SGLANG_PATHP_DISK_DIR"
            )
        if out.disk.enabled and not out.decode_swap_p:
            raise EnvError(
                f"SGLANG_PATHP_DISK_DIR={out.disk.dir!r} is set but SGLANG_DECODE_SWAP_P is not: the disk "
                "tier sits under Path-P's host mirror and would be ignored (set SGLANG_DECODE_SWAP_P=1 or "
                "unset SGLANG_PATHP_DISK_DIR)"
            )
        if out.hisparse_prefetch and out.decode_swap_p:
            raise EnvError(
                "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1 with SGLANG_DECODE_SWAP_P=1: in the prefetch mode "
                "sglang's HiSparse owns the c4 pool and its host copy; unset one of them"
            )
        if out.dump_mode and not out.dump_root:
            raise EnvError(
                "SGLANG_FLASHMEMORY_DUMP=1 needs SGLANG_FLASHMEMORY_DUMP_ROOT=/abs/dir: the only tree "
                "dump requests may write under (their output_dir must lie inside it)"
            )
        return out
