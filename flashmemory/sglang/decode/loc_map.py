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
(graph safe). The table is one storage for the adapter's lifetime. Top-k picks are resolved per row instead
(`LocMap.mirror_chunks`), so requests sharing prefix pages each read their own resident cells.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashmemory.offload import streams
from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.sync import ChunkStore
from flashmemory.sglang.decode.geometry import read_chunk_rows


def _up(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`, staged through page-locked memory where streams order the device (the host
    does not wait for the copy; torch's pinned allocator keeps the staging until the copy is done)."""
    if not streams.streams_on(device):
        return t.to(device)
    stage = streams.pinned_empty(tuple(t.shape), t.dtype)
    stage.copy_(t)
    return stage.to(device, non_blocking=True)


class LocMap:
    """Pool loc -> mirror chunk per served row; pages are mapped once, in logical order (see the module doc).

    Prefix sharing (sglang's radix cache, copy mode): requests may hold the same pool pages, each with its own mirror
    pages and its own resident set. A shared page sits at the same logical position in every sharer (a radix-cache
    prefix starts at token 0), so `chunk` (loc -> logical chunk) is one table for all of them, and a pick is
    resolved per row: `row_mpages[engine row, logical page]` is that row's mirror page (`cells`). `table` (loc ->
    one live sharer's mirror chunk) serves what has no row: the stores of a step's new chunks (never on a shared
    page) and mask mode. A pool page keeps its entries while any row maps it (a list of users per page)."""

    def __init__(
        self, n_locs: int, page_chunks: int, no_chunk: int, device: torch.device, max_rows: int = 1, max_pages: int = 1
    ):
        self.page_chunks, self.no_chunk, self.n_locs = page_chunks, no_chunk, n_locs
        self.table = torch.full((n_locs + 1,), no_chunk, dtype=torch.int64, device=device)
        self.chunk = torch.full((n_locs + 1,), -1, dtype=torch.int32, device=device)  # loc -> logical chunk
        # engine row -> mirror page per logical page (-1 none); the last row is all -1 (padding rows read it)
        self.row_mpages = torch.full((max_rows + 1, max_pages), -1, dtype=torch.int32, device=device)
        self._mapped: dict[int, list[int]] = {}  # row -> pool pages whose entries are written, logical order
        self._mirrors: dict[int, list[int]] = {}  # row -> their mirror pages
        self._users: dict[int, list[tuple[int, int]]] = {}  # pool page -> [(row, mirror page)] of its live users
        # Engine row of each batch row of the step (-1 padding), static for the graph (`batch_chunks`).
        self.batch_rows = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self._batch: list[int] = []  # what batch_rows holds

    def size_batch(self, rows: int) -> None:
        """Room for decode batches of `rows` rows (CUDA-graph padding included); call before any capture."""
        if rows > self.batch_rows.shape[0]:
            self.batch_rows = torch.full((rows,), -1, dtype=torch.int64, device=self.batch_rows.device)
            self._batch = []

    def set_batch(self, rows: list[int]) -> None:
        """The step's engine row per batch row (-1: none). Written only when it changed (a request joined, left
        or moved), from page-locked staging with non_blocking (the host does not wait for the copy)."""
        if rows == self._batch:
            return
        self.size_batch(len(rows))
        n, dev = self.batch_rows.shape[0], self.batch_rows.device
        stage = torch.full((n,), -1, dtype=torch.int64)
        stage[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
        self.batch_rows.copy_(_up(stage, dev))
        self._batch = list(rows)

    def batch_chunks(self, locs: torch.Tensor) -> torch.Tensor:
        """`mirror_chunks` of top-k pool locs [B, K] of the step's batch rows (`set_batch`). Graph safe."""
        if locs.shape[0] > self.batch_rows.shape[0]:
            raise RuntimeError(
                f"FlashMemory: a batch of {locs.shape[0]} rows exceeds the {self.batch_rows.shape[0]} the loc map "
                "was sized for before capture"
            )
        return self.mirror_chunks(locs, self.batch_rows[: locs.shape[0]])

    def map(self, row: int, pools: Sequence[int], mirrors: Sequence[int]) -> None:
        """Entries for the logical pages of `row` that have both a pool page (`pools`) and a mirror page
        (`mirrors`) and are not mapped yet, in one indexed write (a row whose page list did not grow costs
        nothing). If the pool pages moved under the row, everything of it is mapped again."""
        pools = list(pools)
        done = self._mapped.get(row, [])
        n = min(len(pools), len(mirrors))
        if pools[: len(done)] != done:
            self.unmap(row)
            done = []
        if n > len(done):
            k, new, mps = len(done), pools[len(done) : n], [int(m) for m in mirrors[len(done) : n]]
            if k + len(new) > self.row_mpages.shape[1]:
                raise ValueError(f"row {row}: {k + len(new)} pages exceed the map's {self.row_mpages.shape[1]}")
            for p, mp in zip(new, mps):
                self._users.setdefault(p, []).append((row, mp))
            pc, dev = self.page_chunks, self.table.device
            off = torch.arange(pc)
            src = _up((torch.tensor(new).unsqueeze(1) * pc + off).reshape(-1), dev)
            self.table[src] = _up((torch.tensor(mps).unsqueeze(1) * pc + off).reshape(-1), dev)
            self.chunk[src] = _up((torch.arange(k, n).unsqueeze(1) * pc + off).reshape(-1).to(torch.int32), dev)
            self.row_mpages[row, k:n] = _up(torch.tensor(mps, dtype=torch.int32), dev)
            self._mirrors[row] = self._mirrors.get(row, [])[:k] + mps
            done = pools[:n]
        self._mapped[row] = list(done)

    def unmap(self, row: int) -> None:
        """The row leaves: its pages' locs read `no_chunk` again unless another row still maps them (their loc ->
        mirror chunk entries then name a survivor's mirror page)."""
        pages = self._mapped.pop(row, [])
        self._mirrors.pop(row, None)
        gone, kept, kept_mp = [], [], []
        for p in pages:
            users = [u for u in self._users.get(p, []) if u[0] != row]
            if users:
                self._users[p] = users
                kept.append(p)
                kept_mp.append(users[0][1])
            else:
                self._users.pop(p, None)
                gone.append(p)
        pc, dev = self.page_chunks, self.table.device
        off = torch.arange(pc)
        if gone:
            idx = _up((torch.tensor(gone).unsqueeze(1) * pc + off).reshape(-1), dev)
            self.table[idx] = self.no_chunk
            self.chunk[idx] = -1
        if kept:
            idx = _up((torch.tensor(kept).unsqueeze(1) * pc + off).reshape(-1), dev)
            self.table[idx] = _up((torch.tensor(kept_mp).unsqueeze(1) * pc + off).reshape(-1), dev)
        if pages:
            self.row_mpages[row].fill_(-1)

    def mirror_chunks(self, locs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Pool locs [B, K] (-1 empty) of engine rows [B] (-1 padding) -> int64 [B, K] mirror chunks of each row's
        own copy, `no_chunk` where the loc is not one of that row's mapped pages. Static shapes, no host sync."""
        n, pc = self.n_locs, self.page_chunks
        max_rows, max_pages = self.row_mpages.shape[0] - 1, self.row_mpages.shape[1]
        idx = torch.where((locs >= 0) & (locs < n), locs.long(), torch.full_like(locs, n, dtype=torch.long))
        c = self.chunk[idx].long()
        r = torch.where((rows >= 0) & (rows < max_rows), rows.long(), torch.full_like(rows, max_rows, dtype=torch.long))
        page = (c.clamp_min(0) // pc).clamp_max(max_pages - 1)
        mp = self.row_mpages[r.unsqueeze(1).expand_as(page), page].long()
        return torch.where((c >= 0) & (mp >= 0), mp * pc + c.clamp_min(0) % pc, torch.full_like(c, self.no_chunk))


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
    locs = (_up(locs.long(), locs_map.table.device) if not streams.is_device(locs) else locs).long()
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
