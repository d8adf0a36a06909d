"""The device-memory budget FlashMemory's start-up check holds the adapter to: the bytes sglang leaves outside
`--mem-fraction-static`, less what sglang itself needs there.

sglang sizes its static pools (weights + KV) to `mem_fraction_static` of the GPU before the plugin attaches; the
rest, `total x (1 - mem_fraction_static)`, is the runtime headroom its own formula reserves for activations and
CUDA graphs (srt/arg_groups/memory_hook.py: 512 MiB + 1.5 MiB per activation token, at least 2,048 tokens, + tp/8
GiB + 2 MiB per decode-graph batch; a floor of 10 GiB on GPUs over 60 GiB is slack, not need). Everything
FlashMemory allocates after that comes out of this headroom, except in shrink mode what it did not let sglang
allocate (the c4 KV pool it replaces, `saved`). So the check is

    need.total <= min(total x (1 - mem_fraction_static) + saved, free now) - runtime need

where need counts the adapter's static tensors (`adapter_factory.memory_plan`: reserve, copy mode's second copy
of the target index keys, lookup and resident tables, the loc map), the retriever's parameters and buffers, the
Level-1 worker's peak transients (the dequantized target keys of one whole history per target layer, fp32, and
as much again for the retriever's activations over them; with the miss monitor, native scores [heads, history])
and the device side of one recall copy (the staged pages land in a device temporary before the indexed copy:
c4 KV and Path-I index-K pages of the rows one Level-1 job recalls at most). Where the GPU's memory or the
fraction is not known (CPU, tests without server args) the older check stands: the static tensors within 90% of
the bytes free. A failing check stops start-up
before capture, in one line naming the settings to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flashmemory.sglang.decode.core_config import CoreConfig
from flashmemory.sglang.decode.geometry import PoolGeometryError
from flashmemory.sglang.decode.refusals import setting

MIB = 2**20
NATIVE_HEADS = 64  # DeepSeek-V4's indexer heads (the miss monitor's native scores)


@dataclass(frozen=True)
class DeviceNeed:
    """Device bytes FlashMemory takes from sglang's runtime headroom, by item (see the module doc)."""

    static: int  # the adapter's static tensors (memory_plan.device), target copy included
    target_copy: int  # ... of which copy mode's second copy of the target index keys
    retriever: int  # the retriever's parameters and buffers, placed on the device
    worker_peak: int  # the Level-1 worker's peak transients
    recall_staging: int  # the device temporary of one recall copy
    saved: int = 0  # stock device bytes not allocated (shrink mode: the c4 KV pool the reserve replaces)

    @property
    def total(self) -> int:
        return self.static + self.retriever + self.worker_peak + self.recall_staging


def module_bytes(module: Any) -> int:
    """Bytes of a torch module's parameters and buffers (0 for None)."""
    if module is None:
        return 0
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def worker_peak_bytes(core: CoreConfig, monitor: bool) -> int:
    """The Level-1 worker's peak device transients for one request of the longest history: its target keys
    dequantized to fp32 [max_chunks, D] per target layer, and as much again for the retriever's work on them;
    with the miss monitor, native scores fp32 [heads, max_chunks]."""
    lay, n = core.layout, core.engine.max_chunks
    keys = len(lay.target_layers) * n * lay.index_head_dim * 4
    return 2 * keys + (NATIVE_HEADS * n * 4 if monitor else 0)


def recall_staging_bytes(core: CoreConfig) -> int:
    """The device temporary of one recall copy: the pages one Level-1 job recalls at most (the rows due in one
    step: ceil(rows / tau) with the staggered cadence, every row without; at the per-request cap each; at most
    the recall blocks), c4 KV of every layer plus the Path-I index-K."""
    lay, cfg, l1 = core.layout, core.engine, core.level1
    rows = max(1, math.ceil(cfg.max_rows / l1.tau)) if l1.stagger else cfg.max_rows
    pages = min(cfg.recall_blocks, rows * cfg.max_resident_pages)
    return pages * (lay.n_layers * lay.kv_page_bytes + len(lay.offload_index_layers) * lay.index_page_bytes)


def runtime_need_bytes(server_args: Any) -> int:
    """What sglang needs of its runtime headroom on a decode server (its own default formula, without the 10 GiB
    floor): 512 MiB + 1.5 MiB x max(running requests x draft tokens, 2048) + tp/8 GiB + 2 MiB x decode-graph
    batch (none with CUDA graphs off)."""
    get = lambda name, default: setting(server_args, name, None) or default  # noqa: E731  (as sglang resolved it)
    graph_bs = 0 if get("disable_cuda_graph", False) else int(get("cuda_graph_max_bs_decode", 0))
    running = int(get("max_running_requests", 0)) or graph_bs or 1
    tokens = max(running * int(get("speculative_num_draft_tokens", 1)), 2048)
    mib = 512 + 1.5 * tokens + int(get("tp_size", 1)) * int(get("pp_size", 1)) / 8 * 1024 + 2 * graph_bs
    return int(mib * MIB)


def check_device_budget(
    need: DeviceNeed, total: int, mem_fraction_static: float, runtime_need: int, free: int | None
) -> None:
    """Refuse (PoolGeometryError, one line naming the settings) when `need` does not fit what sglang leaves
    outside --mem-fraction-static (plus `need.saved`, within the bytes free now) after its own runtime need."""
    headroom = int(total * (1.0 - mem_fraction_static)) + need.saved
    room = (headroom if free is None else min(headroom, free)) - runtime_need
    if need.total <= room:
        return
    gib = 2**30
    parts = (
        f"static {need.static / gib:.2f} GiB (of which the target index copy {need.target_copy / gib:.2f}), "
        f"retriever {need.retriever / gib:.2f}, Level-1 worker {need.worker_peak / gib:.2f}, "
        f"recall staging {need.recall_staging / gib:.2f}"
    )
    raise PoolGeometryError(
        f"FlashMemory needs {need.total / gib:.2f} GiB of device memory ({parts}) but sglang leaves "
        f"{max(room, 0) / gib:.2f} GiB for it outside --mem-fraction-static {mem_fraction_static:g} "
        f"(headroom {headroom / gib:.2f} GiB minus {runtime_need / gib:.2f} GiB for activations and CUDA graphs): "
        "lower --mem-fraction-static, or SGLANG_PATHP_RESERVE_PAGES, SGLANG_PATHP_DECODE_MAX_CONC or "
        "SGLANG_PATHP_DECODE_RESIDENT_CHUNKS"
    )


def device_memory(device: Any) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device, None elsewhere."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)
