"""How an sglang 0.5.23 DeepSeek-V4 decode server sizes its KV pools and so how many requests it admits: the
arithmetic of `DSV4PoolConfigurator` (srt/model_executor/pool_configurator.py) and of the default
`--mem-fraction-static` (srt/arg_groups/memory_hook.py), restated as pure functions of the geometry and the launch
flags. tests/costmodel/test_pools.py checks every figure against those functions on the installed package.

Per GPU (every TP rank holds the whole KV of every request: one shared KV head):
- available = HBM x mem_fraction - weights / tp (the weight shard).
- fixed = c128 compress state (one 128-row ring per request slot, fp32 [rows, 2 x 512], 20 layers) + the SWA
  pool in cap mode (a decode server with --max-running-requests and no explicit --swa-full-tokens-ratio: 768
  slots per request, plus 4 tails of 384 per request when the radix cache is on), priced per SWA slot.
- full tokens = (available - fixed) / bytes_per_full_token, floored to the 256-token page. A token costs, per c4
  layer, 1/(4 x host_to_device_ratio) of a 585-B padded c4 slot plus 1/4 of a 132-B index key; per c128 layer
  1/128 of an 864-B padded slot. HiSparse's ratio shrinks only the c4 KV term; FlashMemory's
  SGLANG_PD_CREDIT_OFFLOADED_C4 removes it.
- A request holds its whole context in logical full tokens, so admitted = full tokens // context (and at most
  --max-running-requests). HiSparse also needs `device_buffer_size + 64` slots of the device c4 pool, which has
  full // (4 x ratio) slots.
"""

from __future__ import annotations

import math
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


def padded_bytes_per_token(ratio: int) -> float:
    """Bytes one token slot of a page-padded KV pool costs: ratio 0 = SWA (page 256), 4 = c4 (page 64),
    128 = c128 (page 2). c4 585.0, c128 864.0, SWA 585.0."""
    page = PAGE // ratio if ratio else PAGE
    return math.ceil(page * KV_ENTRY / PAD) * PAD / page


@dataclass(frozen=True)
class Serving:
    """Launch flags of the decode server that decide its pools. `mem_fraction` None = sglang's default formula;
    `credit_c4`: FlashMemory's pool credit of the offloaded c4 KV; `hisparse_ratio` 1 = no HiSparse."""

    max_running: int = 256  # sglang's DeepSeek-V4 default (deepseek_v4_hook)
    mem_fraction: float | None = None
    radix_cache: bool = False  # PD decode with HiSparse requires it off
    cuda_graph: bool = True
    decode_extra_slots: int = 0
    hisparse_ratio: int = 1
    credit_c4: bool = False

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.hisparse_ratio < 1 or self.decode_extra_slots < 0:
            raise ValueError(
                f"Serving: max_running {self.max_running} and hisparse_ratio {self.hisparse_ratio} "
                f"must be >= 1, decode_extra_slots {self.decode_extra_slots} >= 0"
            )
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            raise ValueError(f"Serving.mem_fraction must lie in (0, 1], got {self.mem_fraction}")


def default_mem_fraction(gpu_mib: float, tp: int, max_running: int, cuda_graph: bool = True) -> float:
    """memory_hook's default for a decode server: 1 - reserved / capacity, reserved (MiB) = 512 + 1.5 x
    max(max_running, 2048) activation tokens + tp/8 GiB + 2 MiB per decode graph batch, at least 10 GiB."""
    graph_bs = min(160, max_running) if cuda_graph else 0
    reserved = 512 + 1.5 * max(max_running, 2048) + tp / 8 * 1024 + 2 * graph_bs
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, GPU_FLOOR_MIB)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def bytes_per_full_token(sv: Serving, s: FlashShape = FlashShape()) -> float:
    """Device bytes one logical token costs across the c4 and c128 pools (cap-mode SWA is fixed, not here).
    Stock 3,899.25; HiSparse ratio 2: 2,363.625; FlashMemory credit: 828.0."""
    c4_kv = 0.0 if sv.credit_c4 else padded_bytes_per_token(4) / (4 * sv.hisparse_ratio)
    return s.n_c4 * (c4_kv + INDEX_KEY / 4) + s.n_c128 * padded_bytes_per_token(128) / 128


def bytes_per_swa_slot(s: FlashShape = FlashShape()) -> float:
    """One SWA slot at every layer plus the c4 compress state priced per SWA slot (ring 8 per 256-slot page)."""
    state = 2 * 2 * (HEAD_DIM + INDEX_DIM) * STATE_DTYPE
    return padded_bytes_per_token(0) * s.n_layers + RING[4] / PAGE * state * s.n_c4


def fixed_bytes(sv: Serving, s: FlashShape = FlashShape()) -> float:
    """Bytes taken before the token pool: c128 compress state + the cap-mode SWA pool (decode server)."""
    slots = sv.max_running + sv.decode_extra_slots + 1
    rows = math.ceil((slots * RING[128] + RING[128] + 1) / 128) * 128
    c128_state = rows * 2 * HEAD_DIM * STATE_DTYPE * s.n_c128
    per_request = s.window + 128 + PAGE + PAGE  # window + eviction interval + page pad + one decode page
    cap = per_request * sv.max_running + (s.window + PAGE) * sv.decode_extra_slots
    tails = 4 * sv.max_running if sv.radix_cache else 0
    swa_tokens = math.ceil((cap + tails * (s.window + PAGE)) / PAGE) * PAGE
    return c128_state + swa_tokens * bytes_per_swa_slot(s)


@dataclass(frozen=True)
class PoolSizes:
    """One GPU's pools: bytes available for KV, the fixed part, the logical token pool and the device c4 slots."""

    mem_fraction: float
    available: float
    fixed: float
    full_tokens: int
    c4_device_slots: int


def pool_sizes(
    gpu_bytes: float, weights_per_gpu: float, tp: int, sv: Serving, s: FlashShape = FlashShape()
) -> PoolSizes:
    """sglang's sizing on one GPU of `gpu_bytes` (the capacity torch reports) holding `weights_per_gpu`."""
    frac = (
        sv.mem_fraction
        if sv.mem_fraction is not None
        else default_mem_fraction(gpu_bytes / 2**20, tp, sv.max_running, sv.cuda_graph)
    )
    avail = gpu_bytes * frac - weights_per_gpu
    fixed = fixed_bytes(sv, s)
    full = int(max(avail - fixed, 0.0) / bytes_per_full_token(sv, s)) // PAGE * PAGE
    return PoolSizes(frac, avail, fixed, full, full // (4 * sv.hisparse_ratio))


def admitted(
    pools: PoolSizes,
    ctx: int,
    sv: Serving,
    hisparse_slots: int | None = None,
    extra_per_request: float = 0.0,
    s: FlashShape = FlashShape(),
) -> tuple[int, str]:
    """(requests of `ctx` tokens the pools hold at once, what binds): the logical token pool, max-running, the
    HiSparse device c4 slots (`hisparse_slots` per request), or `extra_per_request` device bytes each (a
    FlashMemory reserve row) taken from the same budget."""
    if ctx < 1:
        raise ValueError(f"ctx must be >= 1, got {ctx}")
    budget = pools.full_tokens * bytes_per_full_token(sv, s)
    per = ctx * bytes_per_full_token(sv, s) + extra_per_request
    bounds = {"token pool": int(budget // per), "max-running": sv.max_running}
    if hisparse_slots is not None:
        bounds["HiSparse c4 slots"] = pools.c4_device_slots // hisparse_slots
    bound = min(bounds, key=bounds.get)
    return bounds[bound], bound
