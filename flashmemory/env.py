"""Every environment variable FlashMemory reads, in one place.

The names are upstream's (`SGLANG_DECODE_SWAP_P`, `SGLANG_PATHP_*`, `SGLANG_RETRIEVER_*`) so that
existing launch scripts keep working. Upstream's debug and "fix" gates are gone: their fixes are
the plain behaviour here. Read the environment once with `FlashMemoryEnv.from_environ()`; no other
module calls `os.environ` for a gate.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from flashmemory.errors import UserError


class EnvError(UserError):
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


INT_MAX = 2**31 - 1  # counts end up in int32 tensors; anything larger is a typo, not a setting


def _int(env: Mapping[str, str], name: str, default: int, lo: int = 0, hi: int = INT_MAX) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected an integer") from None
    if v < lo:
        raise EnvError(f"{name}={v}: must be >= {lo}")
    if v > hi:
        raise EnvError(f"{name}={v}: must be <= {hi} (a larger value cannot be meant; is it a typo?)")
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
        raise EnvError(
            f"{name}={raw!r}: layer ids {bad} outside [0, {n_c4_layers}) (ids count c4 layers, not model layers)"
        )
    return tuple(ids)


# Upper bounds of the sizing knobs: far above any real server, low enough that a typo (1e12) is named here
# instead of surfacing as an overflow or a failed allocation. Memory itself is checked before allocation
# (`flashmemory.sglang.decode.geometry.check_reserve_memory`).
MAX_POSITION = 1 << 30  # tokens per request (DeepSeek-V4 serves 1,048,576)
MAX_PAGES = MAX_POSITION // (4 * 64)  # c4 pages (64 chunks of 4 tokens) of a MAX_POSITION request
MAX_ROWS = 1 << 16  # concurrent requests
MAX_BLOCKS = 1 << 24  # reserve page blocks per layer


CPU_GATE = "SGLANG_FLASHMEMORY_CPU"


STATS_FILE = "FLASHMEMORY_STATS_FILE"


def stats_file(env: Mapping[str, str] | None = None) -> str:
    """FLASHMEMORY_STATS_FILE: where a scheduler writes its diagnostic counters as JSON ("" = off). A diagnostic
    for `scripts/gpu_check.py`, not a gate, so it is not part of `FlashMemoryEnv`."""
    return (os.environ if env is None else env).get(STATS_FILE, "")


HISPARSE_TRACE = "FLASHMEMORY_HISPARSE_TRACE"


def hisparse_trace(env: Mapping[str, str] | None = None) -> str:
    """FLASHMEMORY_HISPARSE_TRACE: an absolute file the HiSparse CPU swap-in appends every call's top-k picks to,
    as JSON lines ("" = off), to replay the live hot buffer (`flashmemory.eval.hisparse_trace.replay_trace`).
    A diagnostic, not a gate; a relative path is an EnvError (the server's working directory is not the caller's)."""
    raw = ((os.environ if env is None else env).get(HISPARSE_TRACE) or "").strip()
    if raw and not os.path.isabs(raw):
        raise EnvError(f"{HISPARSE_TRACE}={raw!r}: expected an absolute file path")
    return raw


FAULT_INJECT = "FLASHMEMORY_FAULT_INJECT"


@dataclass(frozen=True)
class FaultSpec:
    """FLASHMEMORY_FAULT_INJECT="hook=<hook name>,rid=<regex>[,rank=<n>]": test only. The guarded FlashMemory hook
    `hook` raises a `RequestFailure` for each request of its batch whose id matches `rid` (`re.search`), before its
    body runs; with `rank`, only on that tensor-parallel rank (a failure the other ranks must learn of)."""

    hook: str
    rid: str
    rank: int | None = None


def fault_inject(env: Mapping[str, str] | None = None, hooks: tuple[str, ...] = ()) -> FaultSpec | None:
    """Parse FLASHMEMORY_FAULT_INJECT (None when unset or empty). `hooks`: the hook names it may name (unchecked when
    empty). A malformed value is an EnvError naming the variable."""
    import re

    raw = ((os.environ if env is None else env).get(FAULT_INJECT) or "").strip()
    if not raw:
        return None
    fields: dict[str, str] = {}
    for part in raw.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("hook", "rid", "rank") or key in fields:
            raise EnvError(
                f"{FAULT_INJECT}={raw!r}: expected 'hook=<hook name>,rid=<regex>[,rank=<n>]' (bad part {part!r})"
            )
        fields[key] = value.strip()
    if not fields.get("hook") or not fields.get("rid"):
        raise EnvError(f"{FAULT_INJECT}={raw!r}: needs both hook=<hook name> and rid=<regex>")
    if hooks and fields["hook"] not in hooks:
        raise EnvError(f"{FAULT_INJECT}={raw!r}: unknown hook {fields['hook']!r} (one of {', '.join(sorted(hooks))})")
    try:
        re.compile(fields["rid"])
    except re.error as e:
        raise EnvError(f"{FAULT_INJECT}={raw!r}: rid is not a regular expression ({e})") from None
    rank = fields.get("rank")
    if rank is not None and not rank.isdigit():
        raise EnvError(f"{FAULT_INJECT}={raw!r}: rank must be a non-negative integer, got {rank!r}")
    return FaultSpec(fields["hook"], fields["rid"], int(rank) if rank is not None else None)


LEVEL1_DELAY = "FLASHMEMORY_LEVEL1_DELAY"


@dataclass(frozen=True)
class DelaySpec:
    """FLASHMEMORY_LEVEL1_DELAY="ms=<milliseconds>[,rank=<n>]": test only. The Level-1 worker sleeps that long after
    scoring each request (on rank `n` only, when given): a worker late by a chosen amount on one rank."""

    seconds: float
    rank: int | None = None


def level1_delay(env: Mapping[str, str] | None = None) -> DelaySpec | None:
    """Parse FLASHMEMORY_LEVEL1_DELAY (None when unset or empty); a malformed value is an EnvError naming it."""
    raw = ((os.environ if env is None else env).get(LEVEL1_DELAY) or "").strip()
    if not raw:
        return None
    fields = dict(part.strip().partition("=")[::2] for part in raw.split(","))
    if (
        set(fields) - {"ms", "rank"}
        or not fields.get("ms", "").isdigit()
        or not fields.get("rank", "0").isdigit()
        or int(fields["ms"]) > 60_000
    ):
        raise EnvError(f"{LEVEL1_DELAY}={raw!r}: expected 'ms=<0..60000>[,rank=<n>]'")
    return DelaySpec(int(fields["ms"]) / 1000, int(fields["rank"]) if "rank" in fields else None)


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


def cpu_enabled(env: Mapping[str, str] | None = None) -> bool:
    """SGLANG_FLASHMEMORY_CPU: the CPU execution layer for sglang's DeepSeek-V4 path (`flashmemory.sglang.cpu`).

    Read on its own because sglang's platform discovery asks for it in every process, before anything else."""
    return _bool(os.environ if env is None else env, CPU_GATE, False)


THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"


def cpu_threads_bind_set(env: Mapping[str, str] | None = None) -> bool:
    """sglang's own SGLANG_CPU_OMP_THREADS_BIND (per-rank CPU groups, '|'-separated) is set: the CPU layer then
    leaves sglang's thread binding as it is."""
    return ((os.environ if env is None else env).get(THREADS_BIND) or "all").strip() != "all"


SWA_WINDOW_VAR = "SGLANG_FLASHMEMORY_CPU_SWA_WINDOW"
SGLANG_DSV4_PAGE = 256  # sglang 0.5.23's DeepSeek-V4 page, in tokens (deepseek_v4_backend.py:1258)
SGLANG_SWA_WINDOW = 128  # its sliding window (deepseek_v4_backend.py:161)


@dataclass(frozen=True)
class CpuTinyGeometry:
    """Where a tiny trained model's geometry differs from what sglang 0.5.23 fixes; the CPU layer's rows for it
    (`flashmemory.sglang.cpu.patches_tiny`) take this config.

    swa_window: SGLANG_FLASHMEMORY_CPU_SWA_WINDOW, the sliding window sglang's DeepSeek-V4 backend attends instead
    of its 128 (0 = unset: sglang's own). Needs SGLANG_FLASHMEMORY_CPU=1; a divisor of the 256-token page up to 128
    (the backend asserts the SWA page is a multiple of the window)."""

    swa_window: int = 0


def cpu_tiny_geometry(env: Mapping[str, str] | None = None) -> CpuTinyGeometry:
    """The tiny model's geometry rows' config (read on its own, like `cpu_enabled`: the CPU layer installs before
    `FlashMemoryEnv` is read). A bad value is an EnvError naming the variable."""
    e = os.environ if env is None else env
    raw = (e.get(SWA_WINDOW_VAR) or "").strip()
    if not raw:
        return CpuTinyGeometry()
    try:
        w = int(raw)
    except ValueError:
        raise EnvError(f"{SWA_WINDOW_VAR}={raw!r}: expected a whole number of tokens") from None
    if w < 0 or w > SGLANG_SWA_WINDOW or (w and SGLANG_DSV4_PAGE % w):
        raise EnvError(
            f"{SWA_WINDOW_VAR}={w}: expected a divisor of sglang's {SGLANG_DSV4_PAGE}-token page up to its "
            f"{SGLANG_SWA_WINDOW}-token window (1, 2, 4, ..., 128; 0 = sglang's own)"
        )
    if w and not cpu_enabled(e):
        raise EnvError(f"{SWA_WINDOW_VAR}={w} is a row of the CPU layer: it needs {CPU_GATE}=1")
    return CpuTinyGeometry(w)


MAX_DISK_GB = float(1 << 20)  # 1 PB of page store per rank: a larger value is a typo
MAX_HOST_CACHE_GB = float(1 << 14)  # 16 TB of host page cache per rank


@dataclass(frozen=True)
class DiskTierConfig:
    """The disk tier below the host mirror: where each rank's page store lives and how big it and the
    host-DRAM page cache in front of it may grow. `enabled` iff `dir` is set.

    dir: SGLANG_PATHP_DISK_DIR, an absolute directory ("" = no disk tier); each rank creates its own uniquely named
    store file there. disk_gb: SGLANG_PATHP_DISK_GB, the store's size bound per rank (GB = 1e9 B). host_cache_gb:
    SGLANG_PATHP_HOST_CACHE_GB, the host page cache per rank (GB = 1e9 B). host_mirror_gb:
    SGLANG_PATHP_HOST_MIRROR_GB, the host mirror's landing window per rank (GB = 1e9 B; 0 = unset: full size).
    """

    dir: str = ""
    disk_gb: float = 64.0
    host_cache_gb: float = 8.0
    host_mirror_gb: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.dir)

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_gb * 1e9)

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gb * 1e9)

    @property
    def host_mirror_bytes(self) -> int | None:
        """The landing window's DRAM in bytes, or None (unset: the mirror keeps one slot per page)."""
        return int(self.host_mirror_gb * 1e9) if self.host_mirror_gb > 0 else None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "DiskTierConfig":
        e = os.environ if env is None else env
        d = cls()
        out = cls(
            dir=(e.get("SGLANG_PATHP_DISK_DIR") or "").strip(),
            disk_gb=_float(e, "SGLANG_PATHP_DISK_GB", d.disk_gb, 0.0, MAX_DISK_GB),
            host_cache_gb=_float(e, "SGLANG_PATHP_HOST_CACHE_GB", d.host_cache_gb, 0.0, MAX_HOST_CACHE_GB),
            host_mirror_gb=_float(e, "SGLANG_PATHP_HOST_MIRROR_GB", d.host_mirror_gb, 0.0, MAX_HOST_CACHE_GB),
        )
        if out.dir and not os.path.isabs(out.dir):
            raise EnvError(f"SGLANG_PATHP_DISK_DIR={out.dir!r}: must be an absolute directory")
        mirror_set = bool((e.get("SGLANG_PATHP_HOST_MIRROR_GB") or "").strip())
        for name, v in (
            ("SGLANG_PATHP_DISK_GB", out.disk_gb),
            ("SGLANG_PATHP_HOST_CACHE_GB", out.host_cache_gb),
            ("SGLANG_PATHP_HOST_MIRROR_GB", out.host_mirror_gb if mirror_set else 1.0),
        ):
            if v <= 0:
                raise EnvError(f"{name}={v}: must be > 0")
            if not out.dir and (e.get(name) or "").strip():
                raise EnvError(
                    f"{name} is set but SGLANG_PATHP_DISK_DIR is not: the disk tier is off without a "
                    "directory (set SGLANG_PATHP_DISK_DIR=/abs/dir or unset " + name + ")"
                )
        return out


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
            decode_swap_p=_bool(e, "SGLANG_DECODE_SWAP_P", d.decode_swap_p),
            index_k_offload=_bool(e, "SGLANG_PATHP_INDEX_K_OFFLOAD", d.index_k_offload),
            score_resident=_bool(e, "SGLANG_PATHP_SCORE_RESIDENT", d.score_resident),
            page_recall=_bool(e, "SGLANG_PATHP_PAGE_RECALL", d.page_recall),
            cudagraph=_bool(e, "SGLANG_PATHP_CUDAGRAPH", d.cudagraph),
            async_recall=_bool(e, "SGLANG_PATHP_ASYNC_RECALL", d.async_recall),
            fused_remap=_bool(e, "SGLANG_PATHP_FUSED_REMAP", d.fused_remap),
            stagger_cycle=_bool(e, "SGLANG_PATHP_STAGGER_CYCLE", d.stagger_cycle),
            dump_mode=_bool(e, "SGLANG_FLASHMEMORY_DUMP", d.dump_mode),
            dump_root=(e.get("SGLANG_FLASHMEMORY_DUMP_ROOT") or "").strip(),
            cpu=cpu_enabled(e),
            hisparse_prefetch=_bool(e, "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH", d.hisparse_prefetch),
            hisparse_prefetch_width=_int(
                e, "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH", d.hisparse_prefetch_width, lo=1, hi=MAX_POSITION // 4
            ),
            hisparse_prefetch_budget=_int(
                e, "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_BUDGET", d.hisparse_prefetch_budget, hi=MAX_POSITION // 4
            ),
            page_kmax=_int(e, "SGLANG_PATHP_PAGE_KMAX", d.page_kmax, lo=1, hi=MAX_PAGES),
            page_kmax_ratio=_float(e, "SGLANG_PATHP_PAGE_KMAX_RATIO", d.page_kmax_ratio, 0.0, 1.0),
            target_context=_int(e, "SGLANG_DSV4_TARGET_CONTEXT", d.target_context, lo=1, hi=MAX_POSITION),
            retriever_ckpt=(e.get("SGLANG_RETRIEVER_INLINE_CKPT") or "").strip(),
            retriever_layers=parse_layers(e.get("SGLANG_RETRIEVER_INLINE_LAYERS") or "10,12,20"),
            interval=_int(e, "SGLANG_RETRIEVER_INTERVAL", d.interval, lo=1, hi=1 << 20),
            threshold=_float(e, "SGLANG_RETRIEVER_SIGMOID_THRESH", d.threshold, 0.0, 1.0),
            last_keep=_int(e, "SGLANG_RETRIEVER_LAST_KEEP", d.last_keep),
            first_keep=_int(e, "SGLANG_RETRIEVER_FIRST_KEEP", d.first_keep),
            ensemble_mode="or" if mode in ("or", "max") else "mean",
            page_policy=page_policy,
            max_resident=_int(e, "SGLANG_RETRIEVER_MAX_RESIDENT", d.max_resident),
            max_position=_int(e, "SGLANG_RETRIEVER_MAX_POSITION", d.max_position, lo=1, hi=MAX_POSITION),
            logit_offset=_float(e, "SGLANG_RETRIEVER_LOGIT_OFFSET", d.logit_offset, -1e4, 1e4),
            miss_monitor=_bool(e, "SGLANG_RETRIEVER_MISS_MONITOR", d.miss_monitor),
            miss_threshold=_float(e, "SGLANG_RETRIEVER_MISS_THRESHOLD", d.miss_threshold, 0.0, 1.0),
            miss_low=_float(e, "SGLANG_RETRIEVER_MISS_LOW", d.miss_low, 0.0, 1.0),
            miss_kmax_cap=_int(e, "SGLANG_RETRIEVER_MISS_KMAX_CAP", d.miss_kmax_cap, hi=MAX_PAGES),
            miss_extra_pages=_int(e, "SGLANG_RETRIEVER_MISS_EXTRA_PAGES", d.miss_extra_pages, hi=MAX_BLOCKS),
            miss_shrink_after=_int(e, "SGLANG_RETRIEVER_MISS_SHRINK_AFTER", d.miss_shrink_after, lo=1),
            miss_fallback_after=_int(e, "SGLANG_RETRIEVER_MISS_FALLBACK_AFTER", d.miss_fallback_after, lo=1),
            reserve_pages=_int(e, "SGLANG_PATHP_RESERVE_PAGES", d.reserve_pages, hi=MAX_BLOCKS),
            decode_resident_chunks=_int(
                e, "SGLANG_PATHP_DECODE_RESIDENT_CHUNKS", d.decode_resident_chunks, lo=1, hi=MAX_POSITION // 4
            ),
            decode_max_conc=_int(e, "SGLANG_PATHP_DECODE_MAX_CONC", d.decode_max_conc, lo=1, hi=MAX_ROWS),
            target_concurrency=_int(e, "SGLANG_DSV4_TARGET_CONCURRENCY", d.target_concurrency, lo=1, hi=MAX_ROWS),
            pd_c4_shrink=_bool(e, "SGLANG_PD_B_C4_SHRINK", d.pd_c4_shrink),
            pd_credit_c4=_bool(e, "SGLANG_PD_CREDIT_OFFLOADED_C4", d.pd_credit_c4),
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
