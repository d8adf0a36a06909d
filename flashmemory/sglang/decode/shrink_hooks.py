"""Shrink mode's hooks (`shrink_adapter.ShrinkAdapter`): the device c4 KV pool is never allocated at full size.

Registered with sglang's HookRegistry like the others (`targets.SPECS`, feature "shrink"): the c4 KV pool gets a
one-page placeholder (`around_init_compressed_pools` + `around_make_kv_pool`), its freed bytes are credited to
the token budget (`around_c4_bytes_per_token`), NIXL registers the mirror's c4 regions as host DRAM
(`before_nixl_manager_init`), and compressor stores go to reserve cells (`around_compress`). Every hook runs under
the process's guard (`guard.guarded`, wrapped at the bottom), as those of `hooks.py` do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from flashmemory.sglang.decode.guard import batch_rids, guarded
from flashmemory.sglang.decode.runtime import RUNTIME

logger = logging.getLogger(__name__)


def around_init_compressed_pools(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    RUNTIME.in_compressed_pools = True
    try:
        return original(self, *args, **kwargs)
    finally:
        RUNTIME.in_compressed_pools = False


def around_make_kv_pool(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """The c4 KV pool (page = global page / 4, built by `_init_compressed_pools`) gets a one-page placeholder
    buffer when the shrink will run; `ShrinkAdapter` replaces it with the reserve. The geometry reads the logical
    size from sglang's own pool config (`geometry.shrunk_kv_pages`): nothing is stored on the pool."""
    page, glob, size = kwargs.get("page_size"), kwargs.get("global_page_size"), kwargs.get("size")
    if not (RUNTIME.in_compressed_pools and page and glob and page * 4 == glob and size and RUNTIME.shrink_planned()):
        return original(self, *args, **kwargs)
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import _num_dsv4_physical_kv_pages

    pool = original(self, *args, **{**kwargs, "size": page})
    logger.info(
        "FlashMemory shrink: c4 KV pool of %d pages per layer not allocated on the device",
        _num_dsv4_physical_kv_pages(size, page, glob),
    )
    return pool


def around_c4_bytes_per_token(original: Callable, self: Any, ratio: int, *args: Any, **kwargs: Any) -> float:
    """SGLANG_PD_CREDIT_OFFLOADED_C4: with the shrink, a token costs no c4 KV bytes on the device (index-K stays)."""
    out = original(self, ratio, *args, **kwargs)
    if ratio == 4 and RUNTIME.shrink_planned():
        out -= self._get_paged_kv_bytes_per_token(4) / (4 * getattr(self, "c4_shrink_factor", 1))
    return out


def before_nixl_manager_init(self: Any, args: Any, disaggregation_mode: Any, *rest: Any, **kwargs: Any) -> None:
    """PD decode into the host mirror: the c4 KV entries of `args` already point at the mirror
    (`around_contiguous_buf_infos`); NIXL must register them as DRAM, not VRAM."""
    engine = RUNTIME.engine
    if engine is None:
        return
    hp = engine.host_ptrs()
    ptrs = list(getattr(args, "kv_data_ptrs", None) or [])
    if not any(p in hp for p in ptrs):
        return
    kinds = list(getattr(args, "kv_data_mem_kinds", None) or ["VRAM"] * len(ptrs))
    args.kv_data_mem_kinds = ["DRAM" if p in hp else k for p, k in zip(ptrs, kinds)]
    logger.info("FlashMemory shrink: %d c4 KV regions registered with NIXL as host DRAM", sum(p in hp for p in ptrs))


def _c4_store_at_seam(backend: Any, layer_id: int, compressor: Any) -> bool:
    """The c4 KV compressor of a shrunk pool reaches sglang's store translation seam
    (`compressor_v2.py:227`): not an indexer compressor, not the uniform-fp8 or unified-triton store paths (they
    return or take their locs before the seam), and the layer's compressed pool is this adapter's c4 pool
    (an identity check: no host sync, so it stays inside a captured decode graph)."""
    pool = RUNTIME.pool
    kv = backend.token_to_kv_pool
    if compressor.is_in_indexer or getattr(compressor, "ratio", None) != 4 or getattr(kv, "uniform_fp8", False):
        return False
    if pool is None or kv is not pool or kv.layer_mapping[layer_id][2] is not pool.c4_kv_pool:
        return False
    from sglang.srt.layers.attention.dsv4.unified_kv_gate import is_unified_kv_triton

    return not is_unified_kv_triton()


def around_compress(
    original: Callable,
    self: Any,
    x: torch.Tensor,
    forward_batch: Any,
    layer_id: int,
    compressor: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """CompressorBackendMixin.forward_indexer_compressor (also the c4 KV compressor's entry, a class alias):
    stores at pool locs (`core_metadata.c4_out_loc`) swapped, for that one call, for their reserve cells
    (`ShrinkAdapter.store_cells`, graph safe) in two cases of shrink mode: the c4 KV compressor, whose device pool
    is the reserve (`_c4_store_at_seam`), and the indexer compressor of a layer whose index-K lives in the Path-I
    reserve. Any other compressor, and every one outside shrink mode, stores as stock sglang does."""
    engine = RUNTIME.engine
    if engine is None or engine.mode != "shrink" or forward_batch.forward_mode.is_idle():
        return original(self, x, forward_batch, layer_id, compressor, *args, **kwargs)
    if getattr(compressor, "is_in_indexer", False):
        at_reserve = getattr(compressor, "ratio", None) == 4 and engine.index_in_reserve(
            RUNTIME.c4_layer(self.token_to_kv_pool, layer_id)
        )
    else:
        at_reserve = _c4_store_at_seam(self, layer_id, compressor)
    if not at_reserve:
        return original(self, x, forward_batch, layer_id, compressor, *args, **kwargs)
    cm = self.forward_metadata.core_metadata
    locs = cm.c4_out_loc
    cells = engine.store_cells(locs)
    RUNTIME.fwd.keep_alive.append(cells)  # eager multi-stream: the kernel may run after this call returns
    cm.c4_out_loc = cells
    try:
        return original(self, x, forward_batch, layer_id, compressor, *args, **kwargs)
    finally:
        cm.c4_out_loc = locs


# --- the guard: every hook above, wrapped once (name = the HookSpec's hook; where its forward batch sits) ----------
_GUARDED: dict[str, Any] = {
    "around_init_compressed_pools": None,
    "around_make_kv_pool": None,
    "around_c4_bytes_per_token": None,
    "before_nixl_manager_init": None,
    "around_compress": batch_rids(3),
}
HOOK_NAMES = tuple(_GUARDED)
for _name, _rids in _GUARDED.items():
    globals()[_name] = guarded(_name, _rids, RUNTIME)(globals()[_name])
