"""sglang's DeepSeek-V4 HiSparse host pool on CPU: its allocation without `cudaHostRegister`, its free-RAM
budget without the GPU host's reserve, and the token / page copies between the device buffers and the host pool
that sglang runs with JIT or CUDA/HIP-only kernels. Hooks of rows in `patches_hisparse.HISPARSE_PATCHES`.

Each hook reads the one gate through `patches_hisparse.hisparse_on_cpu` (on CPU with --enable-hisparse; otherwise
sglang's function runs unchanged) and keeps the layer_first layout's bytes: c4 tokens are 584-B items
(`ops.hisparse.copy_c4_tokens`), whole page rows are copied when every index list is page aligned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashmemory.sglang.cpu import patches_hisparse as hp
from flashmemory.sglang.cpu.ops.hisparse import copy_c4_tokens


def alloc_host(
    original: Callable,
    dims: tuple,
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """`alloc_with_host_register` (pool_host/common.py:330) without `cudaHostRegister` (:147): a plain host
    tensor from sglang's allocator, unpinned."""
    if not hp.hisparse_on_cpu():
        return original(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes)
    return allocator.allocate(dims, dtype=dtype, device=device)


def host_budget(original: Callable, requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """`host_memory_budget_bytes` (pool_host/base.py:84-108) keeps 10 GiB of free RAM back
    (`HICACHE_HOST_MEMORY_RESERVE_BYTES`, :28) for a GPU host; on CPU the whole server lives in that RAM and the
    HiSparse host pool of a small model is a few MB, so on a busy box the check went negative ("Requesting
    0.00 GB but only have -6.33 GB free", memory_pool_host.py:290-296). With the gate on, the reserve is not
    kept back (the pool must still fit in the free RAM)."""
    budget = original(requested_bytes, auto_size=auto_size)
    if not hp.hisparse_on_cpu():
        return budget
    from sglang.srt.mem_cache.pool_host import base

    if base._host_memory_budget.get() is not None:  # inside sglang's booking scope: its own snapshot
        return budget
    return budget + base.HICACHE_HOST_MEMORY_RESERVE_BYTES


def backup_tokens(original: Callable, self: Any, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
    """`DeepSeekV4PagedHostPool.backup_tokens_from_device_all_layer` (memory_pool_host.py:501-515; JIT
    `transfer_cache_dsv4_mla` on pointer tables, hisparse.cuh:227-286): token copy device -> host, every layer."""
    if not hp.hisparse_on_cpu() or self.layout != "layer_first":
        return original(self, host_indices, device_indices)
    if not self._has_transfer_indices(host_indices, device_indices):
        return None
    for dev, host in zip(self.device_buffers, self.kv_buffer):
        copy_c4_tokens(dev, host, device_indices.reshape(-1), host_indices.reshape(-1))
    return None


def _page_rows(pool: Any, dst: torch.Tensor, src: torch.Tensor, dst_idx: torch.Tensor, src_idx: torch.Tensor) -> None:
    """Whole c4 page rows: dst[row] <- src[row] for the page-aligned token index lists (slot 0 of each page)."""
    dst[pool._to_page_indices(dst_idx).to(torch.int64)] = src[pool._to_page_indices(src_idx).to(torch.int64)]


def backup_all_layers(
    original: Callable,
    self: Any,
    device_pool: Any,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    io_backend: str,
) -> None:
    """`backup_from_device_all_layer` (memory_pool_host.py:517): its page path calls `transfer_kv_all_layer_mla`,
    imported only on CUDA/HIP (:44-53, a NameError on CPU) -> page-row copies; the token path as above."""
    if not hp.hisparse_on_cpu() or self.layout != "layer_first":
        return original(self, device_pool, host_indices, device_indices, io_backend)
    if not self._has_transfer_indices(host_indices, device_indices):
        return None
    if host_indices.numel() % self.slot_page_size or device_indices.numel() % self.slot_page_size:
        return self.backup_tokens_from_device_all_layer(host_indices, device_indices)
    for dev, host in zip(self.device_buffers, self.kv_buffer):
        _page_rows(self, host, dev, host_indices, device_indices)
    return None


def load_layer(
    original: Callable,
    self: Any,
    device_pool: Any,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    layer_id: int,
    io_backend: str,
    *,
    is_draft: bool = False,
) -> None:
    """`load_to_device_per_layer` (memory_pool_host.py:609-660), the preload of a short request: its token path
    calls JIT `transfer_cache_dsv4_mla` (:629), its page path `transfer_kv_per_layer_mla` (:640, CUDA/HIP only)
    -> token copies / page-row copies host -> device for `layer_id`."""
    if not hp.hisparse_on_cpu() or self.layout != "layer_first":
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)
    if not self._has_transfer_indices(host_indices, device_indices):
        return None
    host, dev = self.kv_buffer[layer_id], self.device_buffers[layer_id]
    if host_indices.numel() % self.slot_page_size or device_indices.numel() % self.slot_page_size:
        copy_c4_tokens(host, dev, host_indices.reshape(-1), device_indices.reshape(-1))
    else:
        _page_rows(self, dev, host, device_indices, host_indices)
    return None
