"""sglang 0.5.23's HiSparse (`--enable-hisparse`) on CPU: the CUDA-only pieces of its DeepSeek-V4 decode path,
replaced by the torch ops of `ops/hisparse.py`, as a table of `Patch` rows (see docs/hisparse.md).

Every hook is gated: it runs the torch version only when this process serves on CPU (the CPU layer's gate) with
HiSparse on (`enable_hisparse` in the server args this process runs with); otherwise it calls sglang's own
function unchanged. Paths are relative to the installed `sglang` package. The host pool's hooks (allocation,
budget, token and page copies) are in `hisparse_pool.py`; this module has the gate, the coordinator's hooks and the
swap-in, and the one table.

The swap-in hook counts every call and, with FLASHMEMORY_HISPARSE_TRACE set, traces it (and every direct admission)
through `hisparse_record.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashmemory.sglang.cpu.hisparse_record import swapin, trace_path, trace_swapin, trace_write
from flashmemory.sglang.cpu.ops.hisparse import (
    ITEM_BYTES,
    copy_c4_tokens,
    load_cache_to_device_buffer_dsv4,
)
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.plumbing.patch_spec import Patch

_HP = "flashmemory.sglang.cpu.patches_hisparse"
_POOL = "flashmemory.sglang.cpu.hisparse_pool"  # the host pool's hooks
_CO = "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator"
_HOST = "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool"


def _server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # no server args published in this process (a unit test, a tool): stock behaviour
        return None


def serving_on_cpu() -> bool:
    """True in a process that serves with --device cpu."""
    return str(getattr(_server_args(), "device", "")) == "cpu"


def hisparse_on_cpu() -> bool:
    """True in a process that serves on CPU with --enable-hisparse (the gate of every HiSparse hook here)."""
    return serving_on_cpu() and bool(getattr(_server_args(), "enable_hisparse", False))


# --- hooks ----------------------------------------------------------------------------------------------------


def admit_direct(result: Any, self: Any, req: Any) -> None:
    """After `admit_request_direct` (hisparse_coordinator.py:878-910): a long request that arrived over PD starts
    with every LRU slot empty, but the swap-in resolves the newest entry (position L-1) to the reserved slot
    without a copy (hisparse.cuh:480-499), and nothing loads that slot before the next c4 entry is written there
    (map_last_loc_to_buffer, :1100). Its c4 bytes are in the host pool only. Recorded here, loaded by
    `fill_newest` at each c4 layer's first swap-in of the request (in `RUNTIME.hisparse.newest_pending`)."""
    if not hisparse_on_cpu() or not getattr(self, "is_dsv4_hisparse", False):
        return
    rid, n0 = int(req.kv.req_pool_idx), int(self.host_token_len(req.kv.kv_allocated_len))
    if trace_path():  # the slot's hot buffer starts over: empty when longer than the buffer, else 0..H-1
        trace_write({"ev": "admit", "rid": rid, "entries": n0, "empty": n0 > self.device_buffer_size})
    pending = RUNTIME.hisparse.newest_pending
    if n0 > self.device_buffer_size:
        pending[rid] = (n0, {int(b.data_ptr()) for b in self.mem_pool_device.kv_buffer})
    else:
        pending.pop(rid, None)


def fill_newest(
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    hot: int,
    real: int,
) -> int:
    """Load the prefill's newest c4 entry into the reserved slot (see `admit_direct`) where still pending for
    this layer; returns the number of tokens copied (584 B each)."""
    key, copied, by_slot = int(device_buffer.data_ptr()), 0, RUNTIME.hisparse.newest_pending
    for b in range(real):
        rid = int(req_pool_indices[b])
        pending = by_slot.get(rid)
        if pending is None or key not in pending[1]:
            continue
        pending[1].discard(key)
        if not pending[1]:
            del by_slot[rid]
        last = int(seq_lens[b]) - 1
        if last < pending[0]:  # else a decode step already wrote a newer entry into the reserved slot
            copy_c4_tokens(
                host_cache, device_buffer, host_cache_locs[rid, last : last + 1], device_buffer_locs[rid, hot : hot + 1]
            )
            copied += 1
    return copied


def swap_in_dsv4(
    original: Callable,
    top_k_tokens: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    item_size_bytes: int,
    num_top_k: int,
    hot_buffer_size: int,
    page_size: int = 1,
    block_size: int = 256,
    num_real_reqs: Any = None,
    miss_src: Any = None,
    miss_dst: Any = None,
    miss_count: Any = None,
    skip_io: bool = False,
) -> None:
    """`load_cache_to_device_buffer_dsv4_mla` (kernels/ops/kvcache/hisparse.py:522; JIT hisparse.cuh:355-722)
    -> `ops.hisparse.load_cache_to_device_buffer_dsv4`, counted. Plan recording (`miss_*`, DSA shared-index
    prefetch only) and `skip_io` (a debug switch) are not on the DSv4 path and are refused."""
    if not hisparse_on_cpu():
        return original(
            top_k_tokens,
            device_buffer_tokens,
            host_cache_locs,
            device_buffer_locs,
            host_cache,
            device_buffer,
            top_k_device_locs,
            req_pool_indices,
            seq_lens,
            lru_slots,
            item_size_bytes,
            num_top_k,
            hot_buffer_size,
            page_size,
            block_size,
            num_real_reqs,
            miss_src,
            miss_dst,
            miss_count,
            skip_io,
        )
    if miss_src is not None or skip_io or page_size != 1 or item_size_bytes != ITEM_BYTES:
        raise NotImplementedError(
            f"HiSparse CPU swap-in: plan recording / skip_io / page_size {page_size} / item "
            f"{item_size_bytes} B are not on the DSv4 path this was written for"
        )
    real = top_k_tokens.shape[0] if num_real_reqs is None else int(num_real_reqs)
    fill_newest(
        host_cache,
        device_buffer,
        host_cache_locs,
        device_buffer_locs,
        req_pool_indices,
        seq_lens,
        hot_buffer_size,
        real,
    )
    picks = top_k_tokens[:real, :num_top_k].clone() if trace_path() else None  # as the indexer handed them
    counts = load_cache_to_device_buffer_dsv4(
        top_k_tokens,
        device_buffer_tokens,
        host_cache_locs,
        device_buffer_locs,
        host_cache,
        device_buffer,
        top_k_device_locs,
        req_pool_indices,
        seq_lens,
        lru_slots,
        num_top_k,
        hot_buffer_size,
        num_real_reqs,
    )
    swapin().add(counts)
    if picks is not None:
        trace_swapin(device_buffer_tokens, picks, req_pool_indices, seq_lens, hot_buffer_size, counts)


def eager_backup(
    original: Callable,
    self: Any,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    req_pool_indices_cpu: torch.Tensor,
) -> None:
    """`HiSparseCoordinator._eager_backup_previous_token` (hisparse_coordinator.py:1168-1263) without the pinned
    index tensor (:1204-1206, needs a CUDA driver) and the backup stream (:1236-1254): on CPU the copy runs
    inline. Same rule: skip a request's first step after staging, else back up when (seq_len - 1) % ratio == 0
    the previous compressed entry (position (seq_len - 1) // ratio - 1, slot min(position, hot)) to its host slot."""
    if not hisparse_on_cpu():
        return original(self, seq_lens, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu)
    ratio, rows, host_locs = self.compress_ratio, [], []
    for i in range(len(seq_lens_cpu)):
        rid = int(req_pool_indices_cpu[i])
        if self._skip_first_backup[rid]:
            self._skip_first_backup[rid] = False
            continue
        if (int(seq_lens_cpu[i]) - 1) % ratio == 0:
            rows.append(i)
    if not rows:
        return None
    for i in rows:
        rid, pos = int(req_pool_indices_cpu[i]), (int(seq_lens_cpu[i]) - 1) // ratio - 1
        host_locs.append(
            self.mem_pool_host.alloc_paged_token_slots(
                self.req_to_host_pool, self.req_to_host_pool_allocated_len, rid, pos, 1
            )
        )
    idx = torch.tensor(rows, dtype=torch.int64, device=seq_lens.device)
    pos = (seq_lens[idx] - 1) // ratio - 1
    device_locs = self.req_to_device_buffer[req_pool_indices[idx], pos.clamp(max=self.device_buffer_size)]
    self.wait_for_pending_backup()
    if self.is_dsv4_hisparse:
        self.mem_pool_host.backup_tokens_from_device_all_layer(torch.cat(host_locs), device_locs)
    else:
        self.mem_pool_host.backup_from_device_all_layer(
            self.mem_pool_device, torch.cat(host_locs), device_locs, io_backend="kernel"
        )
    return None


def sender_host_indices_off(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """After `CommonKVSender.__init__`: on CPU a Mooncake sender (`supports_host_tensor_indices = True`,
    mooncake/conn.py:3312) would make the prefill stage its page indices in pinned memory behind a
    `torch.cuda.Event` (prefill.py:1746-1761, "Found no NVIDIA driver"); off, it takes the plain
    `kv_to_page_indices` path (:1763). Not HiSparse-specific: any Mooncake prefill on CPU needs it."""
    if serving_on_cpu():
        self.supports_host_tensor_indices = False


def destroy(original: Callable, self: Any) -> None:
    """`HiSparseCoordinator.destroy` (hisparse_coordinator.py:811-819) calls `Stream.synchronize`, which
    `torch.cpu.Stream` lacks; on CPU every copy ran inline, so only the host pool is released."""
    if not hisparse_on_cpu():
        return original(self)
    self.mem_pool_host.destroy()
    return None


HISPARSE_PATCHES: tuple[Patch, ...] = (
    Patch(
        "cpu",
        "sglang.srt.mem_cache.pool_host.common.alloc_with_host_register",
        "around",
        f"{_POOL}:alloc_host",
        ("dims", "dtype", "device", "pin_memory", "allocator"),
        "pool_host/common.py:147,330,453 cudaHostRegister via torch.cuda.cudart() (memory_pool_host.py:306) "
        "-> an unpinned host tensor",
    ),
    Patch(
        "cpu",
        "sglang.srt.mem_cache.pool_host.base.host_memory_budget_bytes",
        "around",
        f"{_POOL}:host_budget",
        ("requested_bytes",),
        "pool_host/base.py:28,104-108 a 10 GiB free-RAM reserve for GPU hosts "
        "(memory_pool_host.py:290) -> no reserve on CPU",
    ),
    Patch(
        "cpu",
        "sglang.kernels.ops.kvcache.hisparse.load_cache_to_device_buffer_dsv4_mla",
        "around",
        f"{_HP}:swap_in_dsv4",
        ("top_k_tokens", "device_buffer_tokens", "host_cache_locs"),
        "kernels/ops/kvcache/hisparse.py:522 JIT swap-in (hisparse.cuh:355-722; hisparse_coordinator.py:1509) "
        "-> ops/hisparse.py load_cache_to_device_buffer_dsv4, counted",
    ),
    Patch(
        "cpu",
        f"{_HOST}.backup_tokens_from_device_all_layer",
        "around",
        f"{_POOL}:backup_tokens",
        ("self", "host_indices", "device_indices"),
        "memory_pool_host.py:510 JIT transfer_cache_dsv4_mla (hisparse.cuh:227-286) -> torch token copy",
    ),
    Patch(
        "cpu",
        f"{_HOST}.backup_from_device_all_layer",
        "around",
        f"{_POOL}:backup_all_layers",
        ("self", "device_pool", "host_indices", "device_indices", "io_backend"),
        "memory_pool_host.py:517,535 transfer_kv_all_layer_mla (CUDA/HIP import :44-53) -> page-row copies",
    ),
    Patch(
        "cpu",
        f"{_HOST}.load_to_device_per_layer",
        "around",
        f"{_POOL}:load_layer",
        ("self", "device_pool", "host_indices", "device_indices", "layer_id", "io_backend"),
        "memory_pool_host.py:629,640 transfer_cache_dsv4_mla / transfer_kv_per_layer_mla -> torch copies",
    ),
    Patch(
        "cpu",
        f"{_CO}._eager_backup_previous_token",
        "around",
        f"{_HP}:eager_backup",
        ("self", "seq_lens", "req_pool_indices", "seq_lens_cpu", "req_pool_indices_cpu"),
        "hisparse_coordinator.py:1204-1206 pin_memory=True (no CUDA driver), :1236 backup stream -> inline",
    ),
    Patch(
        "cpu_pd",
        "sglang.srt.disaggregation.common.conn.CommonKVSender.__init__",
        "after",
        f"{_HP}:sender_host_indices_off",
        ("self",),
        "disaggregation/prefill.py:1746-1761 pinned page indices + torch.cuda.Event for Mooncake senders "
        "(mooncake/conn.py:3312) -> the host path :1763 (gate: --device cpu, HiSparse or not)",
    ),
    Patch(
        "cpu",
        f"{_CO}.admit_request_direct",
        "after",
        f"{_HP}:admit_direct",
        ("self", "req"),
        "hisparse_coordinator.py:878-910 + hisparse.cuh:480-499: a PD-admitted long request's newest c4 "
        "entry resolves to the reserved slot, which nothing loads -> load it from the host pool once",
    ),
    Patch(
        "cpu",
        f"{_CO}.destroy",
        "around",
        f"{_HP}:destroy",
        ("self",),
        "hisparse_coordinator.py:811-819 Stream.synchronize (absent on torch.cpu.Stream)",
    ),
)
