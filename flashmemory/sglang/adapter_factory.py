"""`build(pool, env)`: the Path-P adapter for a DSv4 pool, copy mode (`engine_adapter.SGLangOffload`) or shrink
mode (`shrink.ShrunkOffload`), both subclasses of `offload_adapter.OffloadAdapter`. Kept apart from the classes
so no adapter module imports another's subclass or this factory (this module imports both)."""

from __future__ import annotations

import logging
from typing import Any

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload.mirror import check_host_memory
from flashmemory.sglang.engine_adapter import SGLangOffload
from flashmemory.sglang.offload_adapter import OffloadAdapter
from flashmemory.sglang import geometry
from flashmemory.sglang.geometry import check_reserve_memory, pool_buffers, read_geometry, reserve_bytes
from flashmemory.sglang.shrink import ShrunkOffload, landing_chunks, shrink_blockers

logger = logging.getLogger(__name__)


def build(pool: Any, env: FlashMemoryEnv, server_args: Any = None, shrink: bool | None = None,
          retriever: Any = None) -> OffloadAdapter:
    """Adapter for a DSv4 pool, with `retriever` (checked by the plugin at registration) or else
    SGLANG_RETRIEVER_INLINE_CKPT loaded here the same way (`retriever_load.load_serving_retriever`).

    shrink=None decides from the server args: the shrink (`shrink.ShrunkOffload`) when SGLANG_PD_B_C4_SHRINK is
    on and nothing in `shrink.shrink_blockers` rules it out, else copy mode, with a warning naming the reason."""
    if retriever is None and env.retriever_ckpt:
        from flashmemory.sglang.retriever_load import load_serving_retriever, served_model_path
        retriever = load_serving_retriever(env, served_model_path(server_args, []))
    if shrink is None:
        blockers = shrink_blockers(server_args) if env.pd_c4_shrink else []
        shrink = env.pd_c4_shrink and not blockers
        if blockers:
            logger.warning("FlashMemory Path-P in copy mode (the device c4 pool stays full size, no device memory "
                           "saved): SGLANG_PD_B_C4_SHRINK needs %s", "; ".join(f"not {b}" for b in blockers))
    if getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        logger.warning("FlashMemory Path-P with a decode radix cache: requests sharing prefix pages each keep their "
                       "own mirror copy, and a page's residency follows the request that mapped it last")
    geo = read_geometry(pool)
    n_off = geo.n_c4_layers - len(env.retriever_layers) if env.index_k_offload else 0
    tp, nodes = (int(getattr(server_args, k, None) or 1) for k in ("tp_size", "nnodes"))
    mirror_bytes = geo.n_pages * (geo.n_c4_layers * geo.kv_page_bytes + n_off * geo.index_page_bytes)
    if not shrink and env.disk.enabled and env.disk.host_mirror_bytes is not None:   # the disk tier's landing window
        mirror_bytes = min(mirror_bytes, env.disk.host_mirror_bytes)
    check_host_memory(mirror_bytes, processes=max(1, tp // nodes))
    check_reserve_memory(reserve_bytes(env, geo, n_off), geometry.device_free_bytes(pool_buffers(pool)[0][0].device))
    if shrink:
        eng: OffloadAdapter = ShrunkOffload(pool, env, retriever, n_landing=landing_chunks(server_args))
    else:
        eng = SGLangOffload(pool, env, retriever)
    logger.info("FlashMemory Path-P (%s mode): %d c4 layers, %d pool pages, reserve %d blocks/layer, KMAX %d, "
                "retriever %s", eng.mode, eng.geo.n_c4_layers, eng.geo.n_pages, eng.cfg.recall_blocks,
                eng.cfg.max_resident_pages, env.retriever_ckpt or "off (newest pages)")
    return eng
