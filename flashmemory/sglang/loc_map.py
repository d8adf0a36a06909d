"""`LocMap`: sglang's c4 pool locs -> the offload core's mirror chunks, for the requests an adapter serves, and
`pool_chunks`: the pool's bytes at some locs, addressed for the core.

Address spaces (one c4 layer; every c4 layer shares them; 64 entries a page):
  pool loc      page * 64 + off in sglang's c4 pool (`pool.c4_kv_pool.kv_buffer[l]`: uint8 [n_pages, 37440];
                index-K `pool.c4_indexer_kv_pool.index_k_with_scale_buffer[l]`: uint8 [n_pages, 8448]).
  mirror chunk  the core's key (mirror page * 64 + off).
  cell          reserve block * 64 + off: what attention reads through the adapter's `reserve_kv(l)`.
`LocMap.table` int64 [n_locs + 1] on the adapter's device holds the mirror chunk of every loc of a served
request's mapped pages and the core's `no_chunk` elsewhere (the last entry too, where padding and out-of-range
locs are routed), so `cell_table[table[locs]]` finds a loc's reserve cell in two gathers of static tensors
(graph safe). The table is one storage for the adapter's lifetime.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.sync import ChunkStore
from flashmemory.sglang.geometry import read_chunk_rows


class LocMap:
    """Pool loc -> mirror chunk per served row; pages are mapped once, in logical order (see the module doc)."""

    def __init__(self, n_locs: int, page_chunks: int, no_chunk: int, device: torch.device):
        self.page_chunks, self.no_chunk = page_chunks, no_chunk
        self.table = torch.full((n_locs + 1,), no_chunk, dtype=torch.int64, device=device)
        self._mapped: dict[int, list[int]] = {}  # row -> pool pages whose entries are written, logical order

    def map(self, row: int, pools: Sequence[int], mirrors: Sequence[int]) -> None:
        """Entries for the logical pages of `row` that have both a pool page (`pools`) and a mirror page
        (`mirrors`) and are not mapped yet, in one indexed write (a row whose page list did not grow costs
        nothing). If the pool pages moved under the row, everything of it is mapped again."""
        pools = list(pools)
        done = self._mapped.get(row, [])
        n = min(len(pools), len(mirrors))
        if pools[: len(done)] != done:
            self._clear(done)
            done = []
        if n > len(done):
            pc, dev = self.page_chunks, self.table.device
            off = torch.arange(pc)
            src = (torch.tensor(pools[len(done) : n]).unsqueeze(1) * pc + off).reshape(-1)
            dst = (torch.tensor(list(mirrors[len(done) : n])).unsqueeze(1) * pc + off).reshape(-1)
            self.table[src.to(dev)] = dst.to(dev)
            done = pools[:n]
        self._mapped[row] = list(done)

    def unmap(self, row: int) -> None:
        """The row leaves: its mapped locs read `no_chunk` again."""
        self._clear(self._mapped.pop(row, []))

    def _clear(self, pages: list[int]) -> None:
        if pages:
            pc = self.page_chunks
            idx = (torch.tensor(pages).unsqueeze(1) * pc + torch.arange(pc)).reshape(-1)
            self.table[idx.to(self.table.device)] = self.no_chunk


def pool_chunks(
    locs_map: LocMap,
    layout: OffloadLayout,
    bufs: tuple[list[torch.Tensor], list[torch.Tensor]],
    locs: torch.Tensor,
    layers: Sequence[int],
    kv: bool,
    index: bool,
) -> ChunkStore | None:
    """The bytes of pool locs [n] of `layers` as a `ChunkStore` in the core's mirror chunks: KV if `kv` (one
    gather per layer group), the index-K the core keeps (target and Path-I layers) if `index`. bufs: the pool's
    per-layer (KV, index-K) buffers. Locs without a mirror chunk are left out; None when none is left."""
    n_locs = locs_map.table.numel() - 1
    locs = locs.to(locs_map.table.device).long()
    m = locs_map.table[locs.clamp(0, n_locs)]
    ok = (locs >= 0) & (locs < n_locs) & (m != locs_map.no_chunk)
    if not bool(ok.any()):
        return None
    locs, m, layers = locs[ok], m[ok], list(layers)
    rows = read_chunk_rows(layout.kv, bufs[0], locs, layers) if kv else None  # [len(layers), n, 584]
    kept = set(layout.target_layers) | set(layout.offload_index_layers)
    ix = (
        tuple(read_chunk_rows(layout.index, bufs[1], locs, [l])[0] if l in kept else None for l in layers)
        if index
        else None
    )
    return ChunkStore(m, tuple(layers), rows, ix)
