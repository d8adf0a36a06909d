"""The HiSparse arm of the cost model: sglang 0.5.23's `--enable-hisparse` on DeepSeek-V4 (docs/hisparse.md).

What it keeps where, per request (all c4 layers alike):
- device: a hot buffer of `device_buffer_size` c4 slots plus one c4 page (64) per c4 layer, allocated whole at
  admission whatever the history length (coordinator `padded_buffer_size`, `alloc_device_buffer`); the c4
  index keys of the WHOLE history (the indexer pool is not offloaded), all c128 KV and every SWA ring.
- host: the whole c4 KV (`DeepSeekV4PagedHostPool`).
Per decode step: the native lightning indexer scores the whole history at all 21 c4 layers (the baseline's
FLOPs and index-key reads); of the top-512 picks per layer a fraction `1 - hit_rate` misses the hot buffer and
is copied host -> device synchronously, 584 B each, before attention (none while the history fits the buffer:
the kernel's fast path); every 4th step the newest c4 entry of each layer is backed up device -> host.
The swap-in is one kernel launch per c4 layer per step in which one thread block per request walks that request's
hot-buffer slots (LRU); the step waits for it. `swap_kernel_ms` prices it: `swap_layer_us` per c4 layer per wave
of as many requests as the GPU has SMs (a fitted constant, `flashmemory.costmodel.anchors`).
sglang sizes HiSparse's device pools by `host_to_device_ratio` (`flashmemory.costmodel.pools`).

`hit_rate` is not in any config and nobody has published it for V4; the default 0.95 is the >=95% overlap of
adjacent steps' top-k reported for IndexCache (performance-anchors.md). It is a knob, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashmemory.costmodel.bytes import EntryBytes, RequestBytes
from flashmemory.costmodel.flops import FlashShape, RetrieverShape, n_chunks

SGLANG_DEFAULT_BUFFER = 4096  # factory.py: device_buffer_size defaults to 2 * top_k, top_k's default being 2048


@dataclass(frozen=True)
class HiSparseKnobs:
    """`device_buffer_size` (--hisparse-config; the coordinator's top_k is the model's index_topk, 512),
    the hot-buffer hit rate of the per-step picks, and an optional fixed per-step cost of the swap-in."""

    device_buffer_size: int = SGLANG_DEFAULT_BUFFER
    buffer_page: int = 64  # the extra c4 page of padded_buffer_size (slot device_buffer_size = newest entry)
    hit_rate: float = 0.95
    step_overhead_ms: float = 0.0  # per-step launch/sync cost of the swap-in kernels (not in the byte count)
    host_to_device_ratio: int = 2  # --hisparse-config: the device c4 pool is full tokens / (4 x ratio) slots
    swap_layer_us: float = 0.0  # swap-in kernel time per c4 layer per step, per wave of SM-count requests

    def __post_init__(self) -> None:
        if self.device_buffer_size < 1 or self.buffer_page < 0:
            raise ValueError(
                f"HiSparseKnobs: device_buffer_size {self.device_buffer_size} must be >= 1 and "
                f"buffer_page {self.buffer_page} >= 0"
            )
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"HiSparseKnobs.hit_rate must lie in [0, 1], got {self.hit_rate}")
        if not self.step_overhead_ms >= 0.0:
            raise ValueError(f"HiSparseKnobs.step_overhead_ms must be >= 0, got {self.step_overhead_ms}")
        if self.host_to_device_ratio < 1:
            raise ValueError(f"HiSparseKnobs.host_to_device_ratio must be >= 1, got {self.host_to_device_ratio}")
        if not self.swap_layer_us >= 0.0:
            raise ValueError(f"HiSparseKnobs.swap_layer_us must be >= 0, got {self.swap_layer_us}")

    @property
    def padded_slots(self) -> int:
        return self.device_buffer_size + self.buffer_page


def hisparse_swap_tokens(ctx: int, knobs: HiSparseKnobs = HiSparseKnobs(), s: FlashShape = FlashShape()) -> float:
    """c4 entries copied host -> device per decode step over all c4 layers (0 while the history fits the buffer)."""
    if knobs.device_buffer_size < s.index_topk:
        raise ValueError(
            f"device_buffer_size {knobs.device_buffer_size} < index_topk {s.index_topk}: sglang "
            f"refuses it (the buffer must hold one step's picks)"
        )
    n = n_chunks(ctx, s)
    if n <= knobs.device_buffer_size:
        return 0.0
    return (1.0 - knobs.hit_rate) * min(s.index_topk, n) * s.n_c4


def swap_kernel_ms(batch: int, ctx: int, knobs: HiSparseKnobs, n_sm: int, s: FlashShape = FlashShape()) -> float:
    """Synchronous swap-in kernel time per decode step (ms): n_c4 launches, each ceil(batch / n_sm) waves of one
    block per request walking its slots; 0 on the fast path (history within the buffer) or for an empty batch."""
    if n_sm < 1:
        raise ValueError(f"n_sm must be >= 1, got {n_sm}")
    if batch < 1 or n_chunks(ctx, s) <= knobs.device_buffer_size:
        return 0.0
    return s.n_c4 * knobs.swap_layer_us * math.ceil(batch / n_sm) / 1e3


def hisparse_bytes(
    ctx: int,
    knobs: HiSparseKnobs = HiSparseKnobs(),
    s: FlashShape = FlashShape(),
    r: RetrieverShape = RetrieverShape(),
    e: EntryBytes = EntryBytes(),
) -> RequestBytes:
    """Device/host bytes, HBM reads and PCIe bytes per decode step of one HiSparse request of `ctx` tokens.

    device_parts: 'c4 hot buffer', 'index keys', 'c128 kv', 'swa kv'. pcie_step = swap-in (H2D, synchronous)
    + backup of the newest c4 entry (D2H, 1 in 4 steps); recall_cycle = swap-in bytes per `r.interval` steps.
    """
    n = n_chunks(ctx, s)
    dev = {
        "c4 hot buffer": float(s.n_c4 * knobs.padded_slots * e.kv),
        "index keys": float(s.n_c4 * n * e.index_key),
        "c128 kv": float(s.n_c128 * (ctx // s.c128_ratio) * e.kv),
        "swa kv": float(s.n_layers * min(s.window, ctx) * e.kv),
    }
    attend = s.n_c4 * min(s.index_topk, n) * e.kv + dev["c128 kv"] + dev["swa kv"]
    read = dev["index keys"] + attend
    swap = hisparse_swap_tokens(ctx, knobs, s) * e.kv
    backup = s.n_c4 * e.kv / s.c4_ratio
    host = float(s.n_c4 * n * e.kv)
    return RequestBytes("hisparse", sum(dev.values()), host, read, swap + backup, swap * r.interval, dev)
