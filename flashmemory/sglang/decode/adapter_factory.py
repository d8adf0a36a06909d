"""`build(pool, env)`: the Path-P adapter for a DSv4 pool, copy mode (`copy_adapter.CopyAdapter`) or shrink
mode (`shrink_adapter.ShrinkAdapter`), both subclasses of `offload_adapter.OffloadAdapter`. Kept apart from the classes
so no adapter module imports another's subclass or this factory (this module imports both).

Before anything is allocated, `build` checks the host and device memory the adapter will take, counted the way
it is allocated (`memory_plan`): the host mirror with the pinned allocator's power-of-two rounding, and every
device tensor of the core (reserve incl. landing blocks, target index pool, lookup tables, resident tables), held
on a GPU to sglang's runtime headroom with the retriever, the Level-1 worker and a recall's staging
(`memory_budget`).
The retriever follows the server's device: its parameters and buffers move to the pool's device here, so Level 1
scores CUDA hidden states with CUDA weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload.mirror import check_host_memory, mirror_alloc_bytes
from flashmemory.offload.tiered_mirror import mirror_slot_count
from flashmemory.sglang.decode import geometry, memory_budget
from flashmemory.sglang.decode.copy_adapter import CopyAdapter
from flashmemory.sglang.decode.core_config import CoreConfig, core_config
from flashmemory.sglang.decode.geometry import (
    PoolGeometry,
    PoolGeometryError,
    check_reserve_memory,
    pool_buffers,
    read_geometry,
)
from flashmemory.sglang.decode.offload_adapter import OffloadAdapter
from flashmemory.sglang.decode.refusals import setting
from flashmemory.sglang.decode.retriever_load import place_retriever
from flashmemory.sglang.decode.shrink_adapter import ShrinkAdapter, landing_chunks, shrink_blockers

logger = logging.getLogger(__name__)

_I32, _I64 = 4, 8


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes the adapter allocates for one pool. host: the mirror as the host allocator reserves it (pinned:
    each tensor rounded up to a power of two); device: every device tensor the core and the adapter keep for
    the server's lifetime (reserve, target index pool, lookup tables, resident tables, loc2m, byte map)."""

    host: int
    device: int
    reserve: int  # the device reserve alone (part of `device`)
    target: int = 0  # copy mode's second copy of the target index keys (part of `device`)


def memory_plan(core: CoreConfig, geo: PoolGeometry, shrink: bool, disk: Any, pinned: bool) -> MemoryPlan:
    """What `build` allocates for a pool of geometry `geo` with the core configs `core`, as a pure function of
    the sizes (the shapes are those of `DeviceReserve`, `TargetIndexPool`, `ChunkLUT`, `ResidentTables` and the
    adapter's own tables; a test builds the adapter on the `meta` device and compares). shrink: the target
    index pool is a view of sglang's index-K pool and no byte map is kept."""
    lay, cfg = core.layout, core.engine
    n_mirror = cfg.mirror_pages or cfg.max_rows * lay.pages_for(cfg.max_chunks)
    host = mirror_alloc_bytes(lay, mirror_slot_count(lay, cfg, disk, full_mirror=shrink), pinned)
    blocks = cfg.recall_blocks + cfg.max_rows * cfg.decode_pages + 1 + cfg.landing_blocks
    reserve = blocks * (lay.n_layers * lay.kv_page_bytes + len(lay.offload_index_layers) * lay.index_page_bytes)
    target = 0 if shrink else len(lay.target_layers) * n_mirror * lay.index_page_bytes
    lut = (n_mirror * lay.page_chunks + 1) * _I32 + cfg.max_rows * lay.pages_for(cfg.max_chunks) * _I32
    res_cap = cfg.max_resident_pages + cfg.decode_pages
    tables = 3 * cfg.max_rows * res_cap * _I32 + cfg.max_rows * _I32
    loc2m = (geo.n_locs + 1) * _I64
    byte_map = 0 if shrink else lay.kv.page_chunks * lay.kv.chunk_bytes * _I64
    loc_rows = (geo.n_locs + 1) * _I32 + (cfg.max_rows + 1) * lay.pages_for(cfg.max_chunks) * _I32 + cfg.max_rows * _I64
    device = reserve + target + lut + tables + loc2m + loc_rows + byte_map
    return MemoryPlan(host=host, device=device, reserve=reserve, target=target)


def check_device(
    plan: MemoryPlan,
    core: CoreConfig,
    geo: PoolGeometry,
    env: FlashMemoryEnv,
    shrink: bool,
    retriever: Any,
    sa: Any,
    device: torch.device,
) -> None:
    """The start-up device check (`memory_budget`): against sglang's runtime headroom where the GPU's memory and
    --mem-fraction-static are known, else the static tensors within 90% of the bytes free."""
    frac = setting(sa, "mem_fraction_static", None) if sa is not None else None  # as sglang resolved it
    mem = memory_budget.device_memory(device)
    if frac is None or mem is None:
        check_reserve_memory(plan.device, geometry.device_free_bytes(device))
        return
    saved = geo.n_c4_layers * geo.n_pages * geo.kv_page_bytes if shrink and not env.pd_credit_c4 else 0
    need = memory_budget.DeviceNeed(
        static=plan.device,
        target_copy=plan.target,
        retriever=memory_budget.module_bytes(retriever),
        worker_peak=memory_budget.worker_peak_bytes(core, env.miss_monitor) if retriever is not None else 0,
        recall_staging=memory_budget.recall_staging_bytes(core),
        saved=saved,
    )
    memory_budget.check_device_budget(need, mem[1], float(frac), memory_budget.runtime_need_bytes(sa), mem[0])


def build(
    pool: Any, env: FlashMemoryEnv, server_args: Any = None, shrink: bool | None = None, retriever: Any = None
) -> OffloadAdapter:
    """Adapter for a DSv4 pool, with `retriever` (checked by the plugin at registration) or else
    SGLANG_RETRIEVER_INLINE_CKPT loaded here the same way (`retriever_load.load_serving_retriever`), moved to
    the pool's device.

    shrink=None decides from the server args: the shrink (`shrink_adapter.ShrinkAdapter`) when
    SGLANG_PD_B_C4_SHRINK is on and nothing in `shrink_adapter.shrink_blockers` rules it out, else copy mode, with a
    warning naming the reason."""
    if retriever is None and env.retriever_ckpt:
        from flashmemory.sglang.decode.retriever_load import load_serving_retriever, served_model_path

        retriever = load_serving_retriever(env, served_model_path(server_args, []))
    if shrink is None:
        blockers = shrink_blockers(server_args) if env.pd_c4_shrink else []
        shrink = env.pd_c4_shrink and not blockers
        if blockers:
            logger.warning(
                "FlashMemory Path-P in copy mode (the device c4 pool stays full size, no device memory "
                "saved): SGLANG_PD_B_C4_SHRINK needs %s",
                "; ".join(f"not {b}" for b in blockers),
            )
    geo = read_geometry(pool)
    bad = [l for l in env.retriever_layers if l >= geo.n_c4_layers]
    if bad:
        raise PoolGeometryError(
            f"SGLANG_RETRIEVER_INLINE_LAYERS {list(env.retriever_layers)}: the pool has "
            f"{geo.n_c4_layers} c4 layers; {bad} do not exist"
        )
    device = pool_buffers(pool)[0][0].device
    n_landing = landing_chunks(server_args)
    core = core_config(env, geo, landing_blocks=math.ceil(n_landing / geo.page_chunks) if shrink else 0)
    pinned = core.engine.pin_memory if core.engine.pin_memory is not None else torch.cuda.is_available()
    plan = memory_plan(core, geo, bool(shrink), env.disk, pinned)
    tp, nodes = (int(getattr(server_args, k, None) or 1) for k in ("tp_size", "nnodes"))
    check_host_memory(plan.host, processes=max(1, tp // nodes))
    check_device(plan, core, geo, env, bool(shrink), retriever, server_args, device)
    retriever = place_retriever(retriever, device)
    if shrink:
        eng: OffloadAdapter = ShrinkAdapter(pool, env, retriever, n_landing=n_landing)
    else:
        eng = CopyAdapter(pool, env, retriever)
    logger.info(
        "FlashMemory Path-P (%s mode): %d c4 layers, %d pool pages, reserve %d blocks/layer, KMAX %d, "
        "retriever %s on %s; host mirror %.2f GiB%s, device %.2f GiB",
        eng.mode,
        eng.geo.n_c4_layers,
        eng.geo.n_pages,
        eng.cfg.recall_blocks,
        eng.cfg.max_resident_pages,
        env.retriever_ckpt or "off (newest pages)",
        device,
        plan.host / 2**30,
        " pinned" if pinned else "",
        plan.device / 2**30,
    )
    return eng
