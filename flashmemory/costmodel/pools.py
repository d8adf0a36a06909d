"""How an sglang 0.5.23 DeepSeek-V4 decode server sizes its KV pools and so how many requests it admits: the
arithmetic of `DSV4PoolConfigurator` (srt/model_executor/pool_configurator.py), of the default
`--mem-fraction-static` (srt/arg_groups/memory_hook.py) and of the PD decode admission (srt/disaggregation/
decode.py), restated as pure functions of the geometry and the launch flags. tests/costmodel/test_pools.py checks
the figures against those functions on the installed package.

Per GPU (every TP rank holds the whole KV of every request: one shared KV head; with attention DP each DP rank
holds only its own requests):
- available = HBM x mem_fraction - weights / tp (the weight shard) - FlashMemory's reserve when the launch lowers
  --mem-fraction-static by it (`Serving.reserve_bytes`).
- SWA sizing. sglang's DeepSeek-V4 override sets --swa-full-tokens-ratio 0.1 whenever the flag is not given, so
  the configurator runs in RATIO mode (its log: `DSV4 SWA sizing: mode=ratio`): every full token also buys `ratio`
  SWA slots, and one SWA slot costs its 585-B padded entry at all 43 layers plus the c4 compress state priced per
  slot (ring 8 per 256-slot page): 31,875 B. Stock at 0.1: 3,899.25 + 3,187.5 = 7,086.75 B per full token.
  CAP mode (`swa_ratio=None`: no ratio at all, e.g. DeepSeek-V4.1) sizes a fixed SWA pool instead: 768 slots per
  request (window + eviction interval + page pad + a decode page), plus 4 tails of 384 per request with the radix
  cache on.
- fixed = c128 compress state (one 128-row ring per request slot, fp32 [rows, 2 x 512], 20 layers) + the cap-mode
  SWA pool.
- full tokens = (available - fixed) / bytes_per_full_token, floored to the 256-token page; SWA tokens = full x
  ratio, floored to the page (ratio mode). A full token costs, per c4 layer, 1/(4 x host_to_device_ratio) of a
  585-B padded c4 slot plus 1/4 of a 132-B index key; per c128 layer 1/128 of an 864-B padded slot. HiSparse's
  ratio shrinks only the c4 KV term; FlashMemory's SGLANG_PD_CREDIT_OFFLOADED_C4 removes it.
- Admission (PD decode): a request holds its whole context in the full pool plus --num-reserved-decode-tokens
  (reserved per active request); in the SWA pool each live request holds at most window + eviction interval +
  2 pages (768), and admitting one more needs its window tail (page-aligned) + min(max_new_tokens, 4,096) slots
  free. HiSparse also needs `device_buffer_size + 64` slots of the device c4 pool, full // (4 x ratio) slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from flashmemory.costmodel.flops import FlashShape

PAGE = 256  # DSv4 global page (deepseek_v4_backend asserts it)
PAD = 576  # DeepSeekV4SingleKVPool pads every page row to a multiple of 576 B
KV_ENTRY = 584  # V4 layout: 448 fp8 nope + 64 x 2 bf16 rope + 7 scales + 1 pad
INDEX_KEY = 132  # fp8 128 + fp32 scale
STATE_DTYPE = 4  # SGLANG_DSV4_COMPRESS_STATE_DTYPE default float32
RING = {4: 8, 128: 128}  # compress-state ring rows per request without speculative decoding
HEAD_DIM, INDEX_DIM = 512, 128
GPU_FLOOR_MIB = 10 * 1024  # memory_hook: reserve at least 10 GiB on a GPU above 60 GiB
SGLANG_SWA_RATIO = 0.1  # model_overrides/deepseek_v4.py sets it when --swa-full-tokens-ratio is not given
CLIP_MAX_NEW = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: decode.py clips max_new_tokens to it for admission
EVICTION_INTERVAL = 128  # SGLANG_SWA_EVICTION_INTERVAL default
LAUNCH_RESERVED_DECODE = 1024  # --num-reserved-decode-tokens in launch_decode.sh (sglang's own default is 512)


def padded_bytes_per_token(ratio: int) -> float:
    """Bytes one token slot of a page-padded KV pool costs: ratio 0 = SWA (page 256), 4 = c4 (page 64),
    128 = c128 (page 2). c4 585.0, c128 864.0, SWA 585.0."""
    page = PAGE // ratio if ratio else PAGE
    return math.ceil(page * KV_ENTRY / PAD) * PAD / page


@dataclass(frozen=True)
class Serving:
    """Launch flags of the decode server that decide its pools. `mem_fraction` None = sglang's default formula;
    `swa_ratio`: --swa-full-tokens-ratio (sglang's DeepSeek-V4 default 0.1; None = cap mode, no ratio at all);
    `reserved_decode_tokens`: --num-reserved-decode-tokens; `credit_c4`: FlashMemory's pool credit of the
    offloaded c4 KV; `reserve_bytes`: device bytes of FlashMemory's reserve by which the launch lowers
    --mem-fraction-static (0: none, or taken from the headroom); `hisparse_ratio` 1 = no HiSparse; `dp` attention
    data-parallel ranks (--dp with --enable-dp-attention: each rank holds max_running / dp requests)."""

    max_running: int = 256  # sglang's DeepSeek-V4 default (deepseek_v4_hook)
    mem_fraction: float | None = None
    radix_cache: bool = False  # PD decode with HiSparse requires it off
    cuda_graph: bool = True
    decode_extra_slots: int = 0
    hisparse_ratio: int = 1
    credit_c4: bool = False
    swa_ratio: float | None = SGLANG_SWA_RATIO
    reserved_decode_tokens: int = LAUNCH_RESERVED_DECODE
    reserve_bytes: float = 0.0
    dp: int = 1

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.hisparse_ratio < 1 or self.decode_extra_slots < 0 or self.dp < 1:
            raise ValueError(
                f"Serving: max_running {self.max_running}, hisparse_ratio {self.hisparse_ratio} and dp {self.dp} "
                f"must be >= 1, decode_extra_slots {self.decode_extra_slots} >= 0"
            )
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            raise ValueError(f"Serving.mem_fraction must lie in (0, 1], got {self.mem_fraction}")
        if self.swa_ratio is not None and not 0 < self.swa_ratio <= 1:
            raise ValueError(f"Serving.swa_ratio (--swa-full-tokens-ratio) must lie in (0, 1], got {self.swa_ratio}")
        if self.reserved_decode_tokens < 0 or not self.reserve_bytes >= 0:
            raise ValueError(
                f"Serving: reserved_decode_tokens {self.reserved_decode_tokens} and reserve_bytes "
                f"{self.reserve_bytes} must be >= 0"
            )

    @property
    def running_per_rank(self) -> int:
        """Requests one attention rank runs: sglang's max(1, max_running // dp)."""
        return max(1, self.max_running // self.dp)


def default_mem_fraction(gpu_mib: float, tp: int, max_running: int, cuda_graph: bool = True) -> float:
    """memory_hook's default for a decode server: 1 - reserved / capacity, reserved (MiB) = 512 + 1.5 x
    max(max_running, 2048) activation tokens + tp/8 GiB + 2 MiB per decode graph batch, at least 10 GiB."""
    graph_bs = min(160, max_running) if cuda_graph else 0
    reserved = 512 + 1.5 * max(max_running, 2048) + tp / 8 * 1024 + 2 * graph_bs
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, GPU_FLOOR_MIB)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def kv_bytes_per_full_token(sv: Serving, s: FlashShape = FlashShape()) -> float:
    """Device bytes one logical token costs across the c4 and c128 pools (no SWA).
    Stock 3,899.25; HiSparse ratio 2: 2,363.625; FlashMemory credit: 828.0."""
    c4_kv = 0.0 if sv.credit_c4 else padded_bytes_per_token(4) / (4 * sv.hisparse_ratio)
    return s.n_c4 * (c4_kv + INDEX_KEY / 4) + s.n_c128 * padded_bytes_per_token(128) / 128


def bytes_per_swa_slot(s: FlashShape = FlashShape()) -> float:
    """One SWA slot at every layer plus the c4 compress state priced per SWA slot (ring 8 per 256-slot page).
    DeepSeek-V4-Flash: 31,875.0."""
    state = 2 * 2 * (HEAD_DIM + INDEX_DIM) * STATE_DTYPE
    return padded_bytes_per_token(0) * s.n_layers + RING[4] / PAGE * state * s.n_c4


def bytes_per_full_token(sv: Serving, s: FlashShape = FlashShape()) -> float:
    """sglang's coefficient: c4/c128 bytes plus, in ratio mode, `swa_ratio` SWA slots. Stock at 0.1: 7,086.75."""
    swa = 0.0 if sv.swa_ratio is None else sv.swa_ratio * bytes_per_swa_slot(s)
    return kv_bytes_per_full_token(sv, s) + swa


def swa_tail(ctx: int, window: int) -> int:
    """SWA slots decode.py pre-allocates for a request of `ctx` tokens (no decode radix cache): from the page
    holding position ctx - window to the end."""
    start = max(0, ctx - window) // PAGE * PAGE
    return ctx - start


def live_swa_slots(window: int) -> int:
    """SWA slots one decoding request holds at most: window + eviction interval + page pad + one decode page
    (compute_swa_request_cap's per-request term without speculative decoding). 768 for window 128."""
    return window + EVICTION_INTERVAL + PAGE + PAGE


def fixed_bytes(sv: Serving, s: FlashShape = FlashShape()) -> float:
    """Bytes taken before the token pool: c128 compress state + the cap-mode SWA pool (none in ratio mode)."""
    slots = sv.running_per_rank + sv.decode_extra_slots + 1
    rows = math.ceil((slots * RING[128] + RING[128] + 1) / 128) * 128
    c128_state = rows * 2 * HEAD_DIM * STATE_DTYPE * s.n_c128
    if sv.swa_ratio is not None:
        return c128_state
    cap = live_swa_slots(s.window) * sv.running_per_rank + (s.window + PAGE) * sv.decode_extra_slots
    tails = 4 * sv.running_per_rank if sv.radix_cache else 0
    swa_tokens = math.ceil((cap + tails * (s.window + PAGE)) / PAGE) * PAGE
    return c128_state + swa_tokens * bytes_per_swa_slot(s)


def cap_swa_tokens(sv: Serving, s: FlashShape = FlashShape()) -> int:
    """The cap-mode SWA pool (slots)."""
    cap = live_swa_slots(s.window) * sv.running_per_rank + (s.window + PAGE) * sv.decode_extra_slots
    tails = 4 * sv.running_per_rank if sv.radix_cache else 0
    return math.ceil((cap + tails * (s.window + PAGE)) / PAGE) * PAGE


@dataclass(frozen=True)
class PoolSizes:
    """One GPU's pools: the memory fraction used (after the reserve), bytes available for KV, the fixed part, the
    logical full-token pool, the SWA pool and the device c4 slots."""

    mem_fraction: float
    available: float
    fixed: float
    full_tokens: int
    swa_tokens: int
    c4_device_slots: int


def resolved_fraction(gpu_bytes: float, tp: int, sv: Serving) -> float:
    """--mem-fraction-static as given (or sglang's default), lowered by the reserve's share of the GPU."""
    frac = (
        sv.mem_fraction
        if sv.mem_fraction is not None
        else default_mem_fraction(gpu_bytes / 2**20, tp, sv.max_running, sv.cuda_graph)
    )
    return frac - sv.reserve_bytes / gpu_bytes


def pool_sizes(
    gpu_bytes: float, weights_per_gpu: float, tp: int, sv: Serving, s: FlashShape = FlashShape()
) -> PoolSizes:
    """sglang's sizing on one GPU of `gpu_bytes` (the capacity torch reports) holding `weights_per_gpu`."""
    frac = resolved_fraction(gpu_bytes, tp, sv)
    avail = gpu_bytes * frac - weights_per_gpu
    fixed = fixed_bytes(sv, s)
    full = int(max(avail - fixed, 0.0) / bytes_per_full_token(sv, s)) // PAGE * PAGE
    swa = cap_swa_tokens(sv, s) if sv.swa_ratio is None else int(full * sv.swa_ratio) // PAGE * PAGE
    return PoolSizes(frac, avail, fixed, full, swa, full // (4 * sv.hisparse_ratio))


def full_need(n: int, ctx: int, sv: Serving) -> int:
    """Full-pool slots `n` running requests of `ctx` tokens need: each its pages plus the reserved decode tokens."""
    return n * (math.ceil(ctx / PAGE) * PAGE + sv.reserved_decode_tokens)


def swa_need(n: int, ctx: int, max_new: int, s: FlashShape = FlashShape()) -> int:
    """SWA slots `n` >= 1 requests of `ctx` tokens need: the last one admitted needs its window tail (page-aligned)
    + min(max_new_tokens, 4,096) free next to the n - 1 live windows (`live_swa_slots` each) already decoding."""
    newcomer = math.ceil(swa_tail(ctx, s.window) / PAGE) * PAGE + min(max_new, CLIP_MAX_NEW)
    return (n - 1) * live_swa_slots(s.window) + max(newcomer, live_swa_slots(s.window))


def admitted(
    pools: PoolSizes,
    ctx: int,
    sv: Serving,
    hisparse_slots: int | None = None,
    max_new: int = CLIP_MAX_NEW,
    s: FlashShape = FlashShape(),
) -> tuple[int, str]:
    """(requests of `ctx` tokens one attention rank holds at once, what binds): the full token pool (context +
    reserved decode tokens each), the SWA pool (`swa_need`), max-running per rank, or the HiSparse device c4 slots
    (`hisparse_slots` per request)."""
    if ctx < 1:
        raise ValueError(f"ctx must be >= 1, got {ctx}")
    first = swa_need(1, ctx, max_new, s)
    bounds = {
        "token pool": pools.full_tokens // full_need(1, ctx, sv),
        "SWA pool": (pools.swa_tokens - first) // live_swa_slots(s.window) + 1 if pools.swa_tokens >= first else 0,
        "max-running": sv.running_per_rank,
    }
    if hisparse_slots is not None:
        bounds["HiSparse c4 slots"] = pools.c4_device_slots // hisparse_slots
    bound = min(bounds, key=bounds.get)
    return bounds[bound], bound


def smallest_swa_ratio(
    n: int, ctx: int, sv: Serving, max_new: int = CLIP_MAX_NEW, s: FlashShape = FlashShape()
) -> float:
    """The smallest --swa-full-tokens-ratio (rounded up to 1e-5) whose SWA pool holds `swa_need` for `n` requests
    when the full pool holds `full_need` for them, plus one page for the floors; at least what sglang's start-up
    check needs (window + one page)."""
    full = full_need(n, ctx, sv)
    need = max(swa_need(n, ctx, max_new, s), s.window + PAGE + 1) + PAGE
    return min(1.0, math.ceil(need / full * 1e5) / 1e5)


def auto_swa_ratio(
    admits: Callable[[float], int], n_max: int, ctx: int, sv: Serving, s: FlashShape = FlashShape()
) -> tuple[float, int]:
    """(ratio, requests) for a launch that picks the smallest ratio for what its pools admit: start from `n_max`
    requests, size the ratio for them, see how many `admits(ratio)` holds, and size again for those (a smaller
    pool needs a larger ratio per request) until it settles."""
    n = n_max
    ratio = smallest_swa_ratio(max(n, 1), ctx, sv, s=s)
    for _ in range(8):
        got = min(admits(ratio), n_max)
        nxt = smallest_swa_ratio(max(got, 1), ctx, sv, s=s)
        if nxt == ratio:
            return ratio, got
        ratio, n = nxt, got
    return ratio, min(admits(ratio), n_max)


def capped_pools(max_total_tokens: int, sv: Serving, s: FlashShape = FlashShape()) -> tuple[int, int]:
    """(full, SWA) tokens of a server launched with --max-total-tokens below what its memory holds (the CPU
    servers): calculate_pool_sizes_from_max_tokens floors the cap to the page and derives the SWA pool from it."""
    full = max_total_tokens // PAGE * PAGE
    swa = cap_swa_tokens(sv, s) if sv.swa_ratio is None else int(full * sv.swa_ratio) // PAGE * PAGE
    return full, min(swa, full) if sv.swa_ratio is None else swa
