"""sglang's DSv4 c4 pools as the offload core sees them: geometry, chunk rows at pool locs, chunk counts.

The layout (sglang 0.5.23, `mem_cache/deepseek_v4_memory_pool.py`): per c4 layer, KV page rows of 37,440 B
(64 x [448 fp8 nope + 128 bf16 rope] then 64 x 8 scale bytes, padded to 576) and index-K page rows of 8,448 B
(64 x 128 fp8 then 64 x fp32 scale); c4 loc = full loc // 4, page = loc // 64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashmemory.offload import PageFormat

RATIO = 4


class PoolGeometryError(RuntimeError):
    """The sglang pool does not have the DSv4 c4 layout the offload core expects."""


@dataclass(frozen=True)
class PoolGeometry:
    n_c4_layers: int
    n_pages: int  # physical c4 pages per layer (same count for KV and index-K)
    page_chunks: int  # c4 entries per page (sglang page_size // 4 = 64)
    kv_page_bytes: int  # 37440 for the V4 layout
    index_head_dim: int  # 128
    index_page_bytes: int  # 8448

    @property
    def n_locs(self) -> int:
        return self.n_pages * self.page_chunks


def pool_buffers(pool: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(c4 KV page buffers, c4 index-K page buffers), one per c4 layer, as sglang allocates them."""
    kv_pool = getattr(pool, "c4_kv_pool", None)
    ix_pool = getattr(pool, "c4_indexer_kv_pool", None)
    if kv_pool is None or ix_pool is None:
        raise PoolGeometryError(
            f"{type(pool).__name__} has no c4_kv_pool / c4_indexer_kv_pool (not a DSv4 pool with "
            "c4 layers, or unified_kv is on; Path-P needs the paged fp8 c4 pools)"
        )
    ix = getattr(ix_pool, "index_k_with_scale_buffer", None)
    if ix is None:
        raise PoolGeometryError(
            "c4 index-K pool has no fused index_k_with_scale_buffer (fp4 split layout is not supported by Path-P)"
        )
    return list(kv_pool.kv_buffer), list(ix)


def shrunk_kv_pages(pool: Any) -> int | None:
    """Logical page count of a shrink-mode c4 KV pool, None for any other pool.

    In shrink mode (`shrink_hooks.around_make_kv_pool`) sglang builds the c4 KV pool with a one-page capacity
    (`size == page_size`), so its device buffer is a placeholder the reserve later replaces; the pages its
    allocator hands out still follow the DSv4 pool's own c4 config (`compressed_pool_configs[4].kv_size`), and
    sglang's page count for that size (`_num_dsv4_physical_kv_pages`) is the logical count. Read from sglang's
    attributes only: nothing is stored on the pool."""
    kv_pool = pool.c4_kv_pool
    size, page = getattr(kv_pool, "size", None), getattr(kv_pool, "page_size", None)
    config = (getattr(pool, "compressed_pool_configs", None) or {}).get(RATIO)
    if config is None or not page or size != page:
        return None
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import _num_dsv4_physical_kv_pages

    return int(_num_dsv4_physical_kv_pages(config.kv_size, page, getattr(kv_pool, "global_page_size", page * RATIO)))


def read_geometry(pool: Any) -> PoolGeometry:
    """Geometry from the pool's real buffers; raises PoolGeometryError naming what does not match."""
    kv, ix = pool_buffers(pool)
    kv_pool, ix_pool = pool.c4_kv_pool, pool.c4_indexer_kv_pool
    if not kv or len(kv) != len(ix):
        raise PoolGeometryError(f"{len(kv)} c4 KV buffers but {len(ix)} index-K buffers")
    pc = int(kv_pool.page_size)
    d = int(getattr(ix_pool, "index_head_dim", 128))
    want_kv = PageFormat((576, 8), pc, 576).page_bytes
    kv_pages = shrunk_kv_pages(pool)  # shrink mode: the c4 KV buffer is a placeholder
    kv_rows = kv_pages if kv_pages is not None else (kv[0].shape[0] if kv[0].dim() == 2 else -1)
    ix_rows = ix[0].shape[0] if ix[0].dim() == 2 else -1
    # sglang sizes the two c4 pools from different counts (c4 tokens vs c128 tokens * 32), so they can differ by a
    # page or so; every c4 loc the allocator hands out lies below both.
    n_pages = min(kv_rows, ix_rows)
    for name, bufs, width, rows in (
        ("c4_kv_pool.kv_buffer", kv, want_kv, None if kv_pages is not None else kv_rows),
        ("index_k_with_scale_buffer", ix, pc * (d + 4), ix_rows),
    ):
        for i, t in enumerate(bufs):
            if (
                t.dtype != torch.uint8
                or t.dim() != 2
                or t.shape[1] != width
                or (rows is not None and t.shape[0] != rows)
            ):
                raise PoolGeometryError(
                    f"{name}[{i}]: {t.dtype} {tuple(t.shape)}, expected uint8 [{rows or 'n'}, {width}] "
                    f"(DSv4 V4 fp8 layout, {pc}-entry pages)"
                )
    if n_pages < 1:
        raise PoolGeometryError(f"c4 pools have {kv_rows} KV and {ix_rows} index-K pages")
    return PoolGeometry(len(kv), n_pages, pc, want_kv, d, pc * (d + 4))


def read_chunk_rows(
    fmt: PageFormat,
    bufs: Sequence[torch.Tensor],
    locs: torch.Tensor,
    layers: Sequence[int] | None = None,
    host: bool = True,
) -> torch.Tensor:
    """uint8 [len(layers), n, fmt.chunk_bytes]: chunk rows at pool locs [n] from per-layer page buffers; in host
    memory (a host read of device bytes), or with host=False where the buffers live (no host wait: host locs go
    up through pinned staging, `PageFormat.read_chunks`)."""
    layers = range(len(bufs)) if layers is None else layers
    locs = locs.long()
    out = [fmt.read_chunks(bufs[i], locs // fmt.page_chunks, locs % fmt.page_chunks) for i in layers]
    if not out:
        return torch.zeros(0, locs.numel(), fmt.chunk_bytes, dtype=torch.uint8)
    return torch.stack(out).cpu() if host else torch.stack(out)


def c4_counts(seq_lens: torch.Tensor, ratio: int = RATIO) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode step over rows with token lengths seq_lens [B] (current token included): c4 chunks complete
    before the step and after it. Chunk j closes with the token at position ratio*j + ratio - 1."""
    s = seq_lens.long()
    return (s - 1).clamp_min(0) // ratio, s // ratio


def page_locs(pages: Sequence[int], start: int, stop: int, page_chunks: int) -> torch.Tensor:
    """Int64 pool locs of logical chunks [start, stop) of a row whose logical page p is pool page pages[p]."""
    j = torch.arange(start, stop)
    return torch.tensor(list(pages), dtype=torch.int64)[j // page_chunks] * page_chunks + j % page_chunks


def reserve_bytes(env: Any, geo: PoolGeometry, n_offloaded_index_layers: int) -> int:
    """Device bytes of the reserve the env asks for: (recall blocks + one decode region per row + the sink)
    page blocks, each holding every c4 layer's KV page and the Path-I index pages."""
    decode_pages = math.ceil(env.decode_resident_chunks / geo.page_chunks)
    blocks = env.auto_reserve_pages() + env.decode_max_conc * decode_pages + 1
    return blocks * (geo.n_c4_layers * geo.kv_page_bytes + n_offloaded_index_layers * geo.index_page_bytes)


def check_reserve_memory(need: int, free: int | None, headroom: float = 0.9) -> None:
    """Refuse a reserve that cannot fit in `headroom` of the device's free bytes (None = unknown: no check), with
    the variables that size it, before anything is allocated."""
    if free is None or need <= headroom * free:
        return
    gib = 2**30
    raise PoolGeometryError(
        f"the device reserve needs {need / gib:.1f} GiB but the device has {free / gib:.1f} GiB free "
        f"({headroom:.0%} usable): lower SGLANG_PATHP_RESERVE_PAGES (0 = SGLANG_DSV4_TARGET_CONCURRENCY x "
        "(SGLANG_PATHP_PAGE_KMAX + 1)), SGLANG_PATHP_DECODE_MAX_CONC or SGLANG_PATHP_DECODE_RESIDENT_CHUNKS"
    )


def device_free_bytes(device: torch.device) -> int | None:
    """Free bytes on `device` (CUDA: the driver's count; CPU: MemAvailable), None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        from flashmemory.offload.mirror import host_available_bytes

        return host_available_bytes()
    return None
