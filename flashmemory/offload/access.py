"""`CoreAccess`: the offload core's verbs for callers outside it, besides the request lifecycle.

`OffloadEngine` (engine.py) owns its host mirror, device reserve, lookup table, target index pool, recaller,
block list, resident tables, forward order and lock; a serving adapter names none of them (a scan in
tests/sglang/test_core_boundary.py checks `flashmemory/sglang/`). It calls the lifecycle verbs in engine.py
(`sync_batch`, or `admit` / `decode_append` / `add_pages` / `open_tail_page` / `finish`) and these:

  forward order  `begin_forward`, `end_forward`: the forward stream and gate (Level-1 table writes wait for it).
  Level-2 reads  `cell_table`, `no_chunk`, `reserve_kv`, `slots`, `resident_pages` (static tensors, graph safe).
  stores         `store_chunks` (bytes the caller's storage holds, into the mirror and the resident cells;
                 a decode step hands them to `sync_batch` as `BatchSync.stores` instead),
                 `refresh_cells` (graph safe, one layer's chunk rows into their resident cells),
                 `settle_cells` (bytes a caller's kernel stored in reserve cells, into the mirror;
                 `stage_settle` / `apply_settle`: the same without a host wait, in two halves),
                 `store_index_pages` (whole Path-I index-K pages into the mirror), `storage` (the tensors a
                 caller lends its own pool, e.g. the reserve as sglang's shrunk c4 pool).
  queries        `snapshot_rows`, `gen`, `n_chunks`, `cells`, `target_keys`, `metrics`, `totals`, `occupancy`,
                 `free_blocks`, `free_mirror_pages`, `recent_misses`, `queued_pages`; counters `note`, `record`.

Every verb that reads or writes host bookkeeping takes the core's lock itself; none hands the lock out.
Addresses are the core's own: mirror chunks (mirror page * page_chunks + offset), reserve cells (block *
page_chunks + offset), engine rows; the caller translates its own (sglang's pool locs) into them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashmemory.offload import streams
from flashmemory.offload.sync import StagedSettle

if TYPE_CHECKING:
    from flashmemory.offload.counters import OffloadMetrics
    from flashmemory.offload.disk.queued import QueuedPages
    from flashmemory.offload.layout import OffloadLayout
    from flashmemory.offload.lut import ChunkLUT
    from flashmemory.offload.mirror import HostMirror
    from flashmemory.offload.reserve import BlockAllocator, DeviceReserve, TargetIndexPool
    from flashmemory.offload.rows import ResidentTables, RowState
    from flashmemory.offload.streams import ForwardOrder


@dataclass(frozen=True)
class ReserveSlots:
    """The reserve's block layout (see `offload.reserve`): fixed at construction."""

    n_blocks: int  # all blocks: recall | decode regions | sink | landing
    recall_blocks: int
    sink_block: int  # padding rows and unknown stores write here; never read as a pick
    sink_cell: int  # sink_block * page_chunks
    landing_base: int  # first landing block (scratch for prefill stores)
    landing_blocks: int


@dataclass(frozen=True)
class CoreStorage:
    """The core's byte storage, for a caller that lends it to its own pool (shrink mode: the reserve is sglang's
    c4 pool; PD receive lands in the mirror). reserve_kv uint8 [n_layers, n_blocks, kv_page_bytes] (device);
    reserve_index uint8 [n_path_i_layers, n_blocks, index_page_bytes]; mirror_kv / mirror_index the same shapes
    over mirror page slots (host). Writes into them bypass the core's bookkeeping: only for bytes of cells or
    pages the caller was handed (a store cell, a claimed mirror page)."""

    reserve_kv: torch.Tensor
    reserve_index: torch.Tensor
    mirror_kv: torch.Tensor
    mirror_index: torch.Tensor


class CoreAccess:
    """Mixed into `OffloadEngine`; the attributes below are the engine's (built in its constructor)."""

    layout: OffloadLayout
    cfg: Any
    device: torch.device
    mirror: HostMirror
    reserve: DeviceReserve
    target: TargetIndexPool
    lut: ChunkLUT
    blocks: BlockAllocator
    inflight: set[int]
    rows: list[RowState | None]
    stats: OffloadMetrics
    order: ForwardOrder
    tables: ResidentTables
    lock: Any
    queued: QueuedPages | None = None  # shrink mode's DRAM cap on waiting requests (the disk tier sets it)

    _live: Callable[[int], RowState]  # engine.py
    _mchunks: Callable[[RowState, int, int], torch.Tensor]  # engine.py

    # ---- forward order ---------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A forward is being enqueued on the caller's current stream: the core's table writes go on it and
        Level-1 publishes wait (the forward gate) until `end_forward`."""
        self.order.begin_forward()

    def end_forward(self) -> None:
        """The forward is enqueued (or raised): Level-1 publishes may land. Idempotent."""
        self.order.end_forward()

    # ---- Level-2 reads (static tensors: graph safe, no host sync) -----------------------------------
    @property
    def no_chunk(self) -> int:
        """The mirror chunk id that always reads -1 in `cell_table` (route unknown or padding lookups there)."""
        return self.lut.sentinel

    def cell_table(self) -> torch.Tensor:
        """int32 [n_mirror_chunks + 1] on the core's device: mirror chunk -> reserve cell, -1 = not resident (the
        last entry always -1). The same storage for the core's lifetime, so a captured graph may index it."""
        return self.lut.table

    def reserve_kv(self, layer: int) -> torch.Tensor:
        """uint8 [n_blocks, kv_page_bytes]: c4 layer `layer` of the reserve, what Level-2 attention reads."""
        return self.reserve.kv[layer]

    def slots(self) -> ReserveSlots:
        r = self.reserve
        return ReserveSlots(r.n_blocks, r.recall_blocks, r.sink_block, r.sink_cell, r.landing_base, r.landing_blocks)

    def storage(self) -> CoreStorage:
        return CoreStorage(self.reserve.kv, self.reserve.index, self.mirror.kv, self.mirror.index)

    def resident_pages(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 [B, max_resident_pages + decode_pages] resident logical pages of engine rows [B], ascending, -1
        padded (-1 rows: all -1), on the core's device, read under the lock."""
        r = streams.like(rows, self.tables.pages).long()
        with self.lock:
            p = self.tables.pages[r.clamp_min(0)].long()
        return torch.where(r.unsqueeze(1) >= 0, p, torch.full_like(p, -1))

    # ---- stores of bytes the caller holds -------------------------------------------------------------
    def store_chunks(
        self,
        m: torch.Tensor,
        layers: Sequence[int],
        kv: torch.Tensor | None = None,
        index: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Chunk rows the caller's storage holds for admitted mirror chunks m [n] (on the core's device), for
        c4 `layers`: kv uint8 [len(layers), n, kv_chunk_bytes] into the mirror and into each chunk's reserve
        cell where it is resident now; index[j] uint8 [n, index_chunk_bytes] of layer `layers[j]` into the target
        index pool (target layers) or the mirror and the resident cells (Path-I layers), else nowhere. One hold
        of the lock, so a recall cannot publish a chunk between its mirror and its reserve write."""
        pc, lay = self.layout.page_chunks, self.layout
        layers = list(layers)
        every = layers == list(range(lay.n_layers))
        with self.lock:
            cells = self.lut.table[m].long()
            res = cells >= 0
            hit = bool(res.any())
            if kv is not None:
                mr, mo = self.mirror.rows((m // pc).cpu(), write=True), (m % pc).cpu()  # pages -> DRAM rows
                if hit:
                    rc, rr, rrows = cells[res] // pc, cells[res] % pc, kv[:, res.cpu()].to(self.device)
                for j, l in enumerate(layers if not every else [None]):
                    sel = slice(None) if every else slice(j, j + 1)
                    lay.kv.write_chunks(self.mirror.kv if every else self.mirror.kv[l : l + 1], mr, mo, kv[sel])
                    if hit:
                        dst = self.reserve.kv if every else self.reserve.kv[l : l + 1]
                        lay.kv.write_chunks(dst, rc, rr, rrows[sel])
            for l, rows in zip(layers, index or ()):
                if rows is not None:
                    self._store_index(l, m, rows, cells, res)

    def _store_index(self, l: int, m: torch.Tensor, rows: torch.Tensor, cells: torch.Tensor, res: torch.Tensor) -> None:
        lay, pc = self.layout, self.layout.page_chunks
        if l in lay.target_layers:
            buf = self.target.pages[self.target.layers.index(l)]
            lay.index.write_chunks(buf, (m // pc).to(buf.device), (m % pc).to(buf.device), rows.to(buf.device))
        elif l in lay.offload_index_layers:
            i, mr = lay.offload_index_layers.index(l), self.mirror.rows((m // pc).cpu(), True)  # -> DRAM rows
            lay.index.write_chunks(self.mirror.index[i], mr, (m % pc).cpu(), rows)
            if bool(res.any()):
                lay.index.write_chunks(
                    self.reserve.index[i], cells[res] // pc, cells[res] % pc, rows[res.cpu()].to(self.device)
                )

    def refresh_cells(
        self, layer: int, m: torch.Tensor, src: torch.Tensor, src_bytes: torch.Tensor, byte_map: torch.Tensor
    ) -> None:
        """Graph safe (static shapes, device index math, no host sync): for mirror chunks m [T] (`no_chunk` where
        none), copy the kv chunk bytes at flat byte offsets src_bytes [T, kv_chunk_bytes] of the caller's buffer
        `src` into their reserve cells of c4 layer `layer`; chunks not resident write the sink cell.
        byte_map: `layout.kv.byte_map` on the core's device (the caller keeps it: no host copy under capture)."""
        pc, fmt = self.layout.page_chunks, self.layout.kv
        cells = self.lut.table[m].long()
        cells = torch.where(cells >= 0, cells, torch.full_like(cells, self.reserve.sink_cell))
        dst_idx = (cells // pc).unsqueeze(1) * fmt.page_bytes + byte_map[cells % pc]
        dst = self.reserve.kv[layer].view(-1)
        dst[dst_idx.reshape(-1)] = src.view(-1)[src_bytes.reshape(-1)]

    def settle_cells(self, m: torch.Tensor, cells: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """A caller's kernel stored the kv of mirror chunks m [n] in reserve cells [n] (every layer): the bytes go
        to the mirror, and also to the cell each chunk is resident in now where that differs (a recall published
        it meanwhile). Path-I index-K: `index` uint8 [n_path_i_layers, n, index_chunk_bytes], or None to take it
        from the same cells; into the mirror and each chunk's resident cell."""
        lay, pc = self.layout, self.layout.page_chunks
        m, cells = m.long(), cells.long().to(self.device)
        with self.lock:
            rows = lay.kv.read_chunks(self.reserve.kv, cells // pc, cells % pc)  # [L, n, kv] on the device
            mr = self.mirror.rows((m // pc).cpu(), write=True)
            lay.kv.write_chunks(self.mirror.kv, mr, (m % pc).cpu(), rows.cpu())  # a D2H read
            now = self.lut.table[m.to(self.lut.table.device)].long().to(self.device)
            # Every other chunk writes the sink cell (scratch), so no mask is read by the host.
            sink = torch.full_like(now, self.reserve.sink_cell)
            dst = torch.where((now >= 0) & (now != cells), now, sink)
            lay.kv.write_chunks(self.reserve.kv, dst // pc, dst % pc, rows)
            if lay.offload_index_layers:
                ix = (
                    index
                    if index is not None
                    else lay.index.read_chunks(self.reserve.index, cells // pc, cells % pc).cpu()
                )
                lay.index.write_chunks(self.mirror.index, mr, (m % pc).cpu(), ix)
                dst = torch.where(now >= 0, now, sink)
                lay.index.write_chunks(self.reserve.index, dst // pc, dst % pc, ix.to(self.device))

    def stage_settle(self, m: torch.Tensor, cells: torch.Tensor, index: torch.Tensor | None = None) -> StagedSettle:
        """`settle_cells` without a host wait, for the decode thread right after it enqueued a forward: on the
        forward stream, the chunks' kv (and Path-I index-K: `index`, device uint8 [n_path_i_layers, n, bytes],
        or None to take it from the same cells) are gathered from the reserve cells, copied to the cell each chunk
        is resident in now where that differs, and copied into pinned host buffers (non_blocking); an event marks
        the copy. `apply_settle` writes them into the mirror once the event has completed. m: host int64 [n]
        mirror chunks; cells [n]. Without streams the bytes are settled at once (the result is already done)."""
        if not self.order.enabled:
            self.settle_cells(m, cells, None if index is None else index.cpu())
            return StagedSettle(m[:0], None, None, None)
        lay, pc = self.layout, self.layout.page_chunks
        with self.lock, self.order.on_stream():
            cells = streams.like(cells.long(), self.reserve.kv)
            rows = lay.kv.read_chunks(self.reserve.kv, cells // pc, cells % pc)  # [L, n, kv] on the device
            now = self.lut.table[streams.like(m.long(), self.lut.table)].long()
            sink = torch.full_like(now, self.reserve.sink_cell)  # others write the sink (no mask read by the host)
            dst = torch.where((now >= 0) & (now != cells), now, sink)
            lay.kv.write_chunks(self.reserve.kv, dst // pc, dst % pc, rows)
            ix = None
            if lay.offload_index_layers:
                ix = index if index is not None else lay.index.read_chunks(self.reserve.index, cells // pc, cells % pc)
                dst = torch.where(now >= 0, now, sink)
                lay.index.write_chunks(self.reserve.index, dst // pc, dst % pc, ix)
            kv_host, ix_host = streams.download(rows), streams.download(ix)
            done = torch.cuda.Event()
            done.record(self.order.stream)
        return StagedSettle(m.long(), kv_host, ix_host, done)

    def apply_settle(self, staged: StagedSettle, keep: torch.Tensor | None = None, wait: bool = False) -> bool:
        """Write a `stage_settle`'s bytes into the mirror if its copy is complete (or, with `wait`, after waiting
        for it: a host sync). keep: bool [n] host, the chunks still owned by a live request (the others' mirror
        pages may be another request's by now: left alone); None keeps all. Returns whether it was applied."""
        if staged.done is not None and not staged.done.query():
            if not wait:
                return False
            staged.done.synchronize()
        if staged.kv is None or not staged.m.numel():
            return True
        lay, pc = self.layout, self.layout.page_chunks
        m, kv, ix = staged.m, staged.kv, staged.index
        if keep is not None:
            m, kv, ix = m[keep], kv[:, keep], None if ix is None else ix[:, keep]
        with self.lock:
            mr = self.mirror.rows(m // pc, write=True)
            lay.kv.write_chunks(self.mirror.kv, mr, m % pc, kv)
            if ix is not None:
                lay.index.write_chunks(self.mirror.index, mr, m % pc, ix)
        return True

    def store_index_pages(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole Path-I index-K pages into the mirror: pages int64 [n] mirror pages, rows uint8
        [n_path_i_layers, n, index_page_bytes]."""
        with self.lock:
            mr = self.mirror.rows(pages.cpu().long(), write=True)
            for i in range(rows.shape[0]):
                self.mirror.index[i, mr] = rows[i].cpu()

    # ---- queries ---------------------------------------------------------------------------------------
    def snapshot_rows(self) -> dict[int, tuple[int, int]]:
        """{row: (gen, n_chunks)} of every admitted request, taken under the lock: what planners outside the core
        (Level 1) read instead of the rows themselves."""
        with self.lock:
            return {r: (st.gen, st.n_chunks) for r, st in enumerate(self.rows) if st is not None}

    def gen(self, row: int) -> int:
        with self.lock:
            return self._live(row).gen

    def n_chunks(self, row: int) -> int:
        with self.lock:
            return self._live(row).n_chunks

    def cells(self, rows: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """int32 [B, K] reserve cells of logical chunks [B, K] (-1: not resident / invalid) of rows [B]."""
        with self.lock:
            return self.lut.cells(rows, chunks)

    def target_keys(self, row: int, layer: int) -> torch.Tensor:
        """Dequantized index keys [n_chunks, D] fp32 of a target layer for a row's whole history."""
        from flashmemory.retriever.fp8 import dequantize_chunks

        with self.lock:
            st = self._live(row)
            m = self._mchunks(st, 0, st.n_chunks)
            return dequantize_chunks(self.target.chunks(layer, m))

    def free_blocks(self) -> int:
        """Recall blocks on the free list now (a racy read: for gauges and budgets, not for decisions)."""
        return len(self.blocks)

    def free_mirror_pages(self) -> int:
        """Mirror pages not held by any request (a racy read: the caller decides under its own serialisation)."""
        return self.mirror.free_pages

    def occupancy(self) -> dict[str, float]:
        """Gauges read under the lock: free_reserve_blocks, reserve_blocks (recall blocks), and the mirror's
        host_mirror_bytes_in_use, host_mirror_bytes, host_mirror_slots_in_use (DRAM slots)."""
        with self.lock:
            mirror = self.mirror
            return {
                "free_reserve_blocks": float(len(self.blocks)),
                "reserve_blocks": float(self.cfg.recall_blocks),
                "host_mirror_bytes_in_use": float(mirror.slots_in_use * mirror.page_bytes),
                "host_mirror_bytes": float(mirror.physical_bytes),
                "host_mirror_slots_in_use": float(mirror.slots_in_use),
            }

    def queued_pages(self) -> QueuedPages | None:
        """The waiting requests' pages under the disk tier's DRAM cap (shrink mode, SGLANG_PATHP_HOST_MIRROR_GB;
        its verbs `known`, `update`, `refusal` lock the core themselves), None without a cap."""
        return self.queued

    def recent_misses(self) -> list[float]:
        """The miss monitor's most recent miss-mass values (oldest first), read under the lock."""
        with self.lock:
            return list(self.stats.miss_recent)

    def note(self, row: int, name: str, n: int = 1) -> None:
        """Add to a per-request counter of the request in `row` (ignored when the row is empty)."""
        with self.lock:
            st = self.rows[row] if 0 <= row < len(self.rows) else None
            if st is not None:
                self.stats.add(st.rid, name, n)

    def record(
        self, row: int, gen: int, counts: dict[str, int], gauges: dict[str, float], miss: float | None = None
    ) -> None:
        """If `row` still holds generation `gen`: add `counts` to its per-request counters, set `gauges`, and
        observe one miss-mass value (the miss monitor's cycle result). Otherwise nothing."""
        with self.lock:
            st = self.rows[row] if 0 <= row < len(self.rows) else None
            if st is None or st.gen != gen:
                return
            for name, n in counts.items():
                self.stats.add(st.rid, name, n)
            if miss is not None:
                self.stats.observe_miss(miss)
            self.stats.gauge(st.rid, **gauges)

    def totals(self) -> dict[str, Any]:
        """`OffloadMetrics.totals` (running totals, O(1): no scan of requests, no device read) plus free_blocks,
        read under the lock: what a metrics exporter reads while requests decode."""
        with self.lock:
            total = self.stats.totals()
            total["free_blocks"] = len(self.blocks)
            return total

    def metrics(self) -> dict[str, Any]:
        """Plain-dict snapshot: {"total": {...}, "requests": {rid: {...}}} (see `offload.counters.COUNTERS`). Scans
        every request and reads the lookup table (a device read): for tests and reports; exporters use `totals`."""
        with self.lock:
            res = {}
            for r, st in enumerate(self.rows):
                if st is not None:
                    pages = len(st.recall) + sum(p >= 0 for p in st.ring)
                    held = self.lut.cells(torch.tensor([r]), torch.arange(st.n_chunks).unsqueeze(0)) >= 0
                    res[st.rid] = (pages, int(held.sum()))
            snap = self.stats.snapshot(res)
            snap["total"].update(
                free_blocks=len(self.blocks),
                inflight_blocks=len(self.inflight),
                free_mirror_pages=self.mirror.free_pages,
            )
            return snap
