"""`OffloadEngine`: request lifecycle (admit, decode, finish) over the mirror, the reserve and the lookup table.

Its parts (mirror, reserve, lookup table, target pool, recaller, block list, resident tables, forward
order, lock) are its own: callers outside `flashmemory.offload` and `flashmemory.residency` use the lifecycle
verbs here (`sync_batch`, step.py, for a whole decode step; `admit`, `decode_append`, `add_pages`, `open_tail_page`,
`finish`) and the verbs of `access.CoreAccess` (forward order, Level-2 reads, stores of bytes the caller holds,
queries; shrink mode's adapter uses `cell_table`, `no_chunk`, `slots`, `storage`, `settle_cells` and
`store_index_pages`). All host bookkeeping happens under the core's lock, taken inside the verbs. Level-1
recall is executed by `engine.recaller` (`flashmemory.offload.recall.Recaller`, handed one `RecallState` of the
parts it needs; that module never imports this one), which takes the same lock to plan and to publish and
copies bytes without it. Planners outside the core read `snapshot_rows()` instead of the rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashmemory.offload import streams
from flashmemory.offload.access import CoreAccess
from flashmemory.offload.counters import OffloadMetrics
from flashmemory.offload.landing import DeviceLanding, PendingLand
from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.lru import PageLRU
from flashmemory.offload.lut import ChunkLUT
from flashmemory.offload.mirror import HostMirror, OffloadCapacityError
from flashmemory.offload.recall import Recaller
from flashmemory.offload.recall_types import RecallState
from flashmemory.offload.reserve import BlockAllocator, DeviceReserve, TargetIndexPool
from flashmemory.offload.rows import ResidentTables, RowState
from flashmemory.offload.step import StepSync
from flashmemory.offload.streams import ForwardOrder


@dataclass(frozen=True)
class EngineConfig:
    """Capacities, fixed at construction (never taken from a batch seen at run time)."""

    max_rows: int = 128  # request rows; each owns one decode region
    max_chunks: int = 65536  # history cap per request, in chunks (65,536 = 256K tokens)
    mirror_pages: int = 0  # host mirror pages per layer; 0 = max_rows * pages(max_chunks)
    recall_blocks: int = 8192  # reserve page blocks per layer for recalled pages
    decode_pages: int = 8  # decode-region pages per row (512 chunks at 64-chunk pages)
    max_resident_pages: int = 96  # per-request cap on recalled pages (KMAX)
    landing_blocks: int = 0  # reserve scratch blocks for prefill stores (sglang shrink mode)
    # admission warm start from the host mirror: pages a step may copy host -> device, spent by a caller that
    # holds requests back (`step.admit_within`); an admission handed to `sync_batch` is always copied whole.
    # Admissions whose rows are on the device (copy mode) warm from them and take none of it.
    warm_step_pages: int = 16
    mirror_slots: int = 0  # host mirror DRAM page slots; 0 = one per page (the disk tier's window sets it)
    pin_memory: bool | None = None  # None = pin when CUDA is present

    def __post_init__(self) -> None:
        positive = ("max_rows", "max_chunks", "recall_blocks", "decode_pages", "max_resident_pages", "warm_step_pages")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if min(self.mirror_pages, self.landing_blocks, self.mirror_slots) < 0:
            raise ValueError("EngineConfig.mirror_pages, landing_blocks and mirror_slots must be >= 0")


class OffloadEngine(StepSync, CoreAccess, DeviceLanding):
    """The serving core. Chunk tensors are uint8 chunk rows for all `layout.n_layers` layers:
    kv [n_layers, n, kv_chunk_bytes] (584 B), index [n_layers, n, index_chunk_bytes] (D+4 B).
    """

    def __init__(
        self,
        layout: OffloadLayout,
        cfg: EngineConfig,
        device: torch.device | str = "cpu",
        target_buffers: list[torch.Tensor] | None = None,
    ):
        """target_buffers: per target layer, uint8 [mirror pages, index_page_bytes] device storage to use as the
        target index pool (the caller keeps it current; see `TargetIndexPool`)."""
        self.layout, self.cfg = layout, cfg
        self.device = torch.device(device)
        self.max_pages = layout.pages_for(cfg.max_chunks)
        n_mirror = cfg.mirror_pages or cfg.max_rows * self.max_pages
        self.mirror = self.make_mirror(n_mirror)
        self.reserve = DeviceReserve(
            layout, cfg.recall_blocks, cfg.max_rows, cfg.decode_pages, self.device, cfg.landing_blocks
        )
        self.target = TargetIndexPool(layout, n_mirror, self.device, target_buffers)
        self.lut = ChunkLUT(n_mirror, layout.page_chunks, cfg.max_rows, self.max_pages, self.device)
        self.blocks, self.lru = BlockAllocator(cfg.recall_blocks), PageLRU()
        self.owner: list[tuple[int, int, int] | None] = [None] * cfg.recall_blocks  # block -> (row, gen, page)
        self.inflight: set[int] = set()
        self.rows: list[RowState | None] = [None] * cfg.max_rows
        self.stats, self._gen = OffloadMetrics(layout.page_chunks), 0
        # The forward stream and the forward gate: handed in at every step (`order.begin_forward`), never taken here.
        self.order = ForwardOrder(self.device)
        # Compact per-row table of resident pages (ascending logical page), for score-resident Level 2.
        self.res_cap = cfg.max_resident_pages + cfg.decode_pages
        self.tables = ResidentTables(self.rows, self.reserve, self.res_cap, self.order, self.stats.residency)
        self.res_pages, self.res_blocks = self.tables.pages, self.tables.blocks
        self.res_mpages, self.res_count = self.tables.mpages, self.tables.count
        # What recall shares with the engine (the same objects), and the lock guarding all host bookkeeping.
        self.recall_state = RecallState(
            layout=layout, max_resident_pages=cfg.max_resident_pages, rows=self.rows, owner=self.owner,
            inflight=self.inflight, blocks=self.blocks, lru=self.lru, lut=self.lut, mirror=self.mirror,
            reserve=self.reserve, tables=self.tables, stats=self.stats, order=self.order, lock=threading.RLock(),
        )  # fmt: skip
        self.recaller = Recaller(self.recall_state)
        self.lands: list[PendingLand] = []  # admissions and copy-mode settles on their way to the mirror (`landing`)
        self.recall_state.before_read = self.ensure_landed  # a recall reads a row's mirror pages once they landed
        self.staging, self.copy_lock = self.recaller.staging, self.recaller.copy_lock  # the recaller's

    def make_mirror(self, n_pages: int) -> HostMirror:
        """The host mirror of `n_pages` page ids (built once, in the constructor, before anything reads it): a
        `HostMirror` with the config's pinning and landing window; the disk tier overrides it."""
        return HostMirror(self.layout, n_pages, self.cfg.pin_memory, self.cfg.mirror_slots or None)

    @property
    def lock(self) -> Any:
        """The lock guarding all host bookkeeping (an RLock), shared with the recaller (`recall_state.lock`)."""
        return self.recall_state.lock

    @lock.setter
    def lock(self, lock: Any) -> None:
        """Swap the lock (a bench wraps it to time holds); the recaller takes the same one from then on."""
        self.recall_state.lock = lock

    @property
    def copy_hook(self) -> Callable[[], None] | None:
        """Called between the KV and index copies of a recall (tests); lives on the recaller."""
        return self.recaller.copy_hook

    @copy_hook.setter
    def copy_hook(self, fn: Callable[[], None] | None) -> None:
        self.recaller.copy_hook = fn

    # ---- helpers -------------------------------------------------------------------------------------
    def on_main_stream(self):
        """Context: work issued inside runs on the forward stream, the one decode reads the tables from."""
        return self.order.on_stream()

    def _live(self, row: int) -> RowState:
        if not 0 <= row < self.cfg.max_rows:
            raise IndexError(f"row {row} outside [0, {self.cfg.max_rows})")
        st = self.rows[row]
        if st is None:
            raise KeyError(f"row {row} holds no request (admit it first)")
        return st

    def _check_chunks(self, what: str, t: torch.Tensor, n: int, width: int) -> None:
        want = (self.layout.n_layers, n, width)
        if t.dtype != torch.uint8 or tuple(t.shape) != want:
            raise ValueError(f"{what}: expected uint8 {want} chunk rows, got {t.dtype} {tuple(t.shape)}")

    def _mchunks(self, st: RowState, start: int, stop: int) -> torch.Tensor:
        pc, j = self.layout.page_chunks, torch.arange(start, stop)
        return torch.tensor(st.mpages, dtype=torch.int64)[j // pc] * pc + j % pc

    # ---- lifecycle ---------------------------------------------------------------------------------
    def admit(
        self,
        row: int,
        kv: torch.Tensor | None,
        index: torch.Tensor | None,
        rid: Hashable | None = None,
        mpages: Sequence[int] | None = None,
        n_chunks: int | None = None,
    ) -> int:
        """Admit a request into a free row with its prefill chunks (written to the mirror; nothing resident yet).

        kv: uint8 [n_layers, n, kv_chunk_bytes]; index: uint8 [n_layers, n, index_chunk_bytes]. Returns the
        request's generation (pass it back to Level 1 so stale work is recognised).
        mpages: claim these mirror pages (logical page order) instead of allocating; then kv may be None (the
        bytes are already in the mirror, e.g. a PD transfer landed there) and index None (the caller writes the
        target and Path-I index itself), with the count given as n_chunks.
        """
        if kv is None and mpages is None:
            raise ValueError("admit: kv=None needs mpages (the pages that already hold the bytes)")
        n = (kv.shape[1] if kv.dim() == 3 else -1) if kv is not None else (-1 if n_chunks is None else int(n_chunks))
        if kv is not None:
            self._check_chunks("admit kv", kv, n, self.layout.kv.chunk_bytes)
        if index is not None:
            self._check_chunks("admit index", index, n, self.layout.index.chunk_bytes)
        if mpages is not None and len(mpages) != self.layout.pages_for(max(n, 1)):
            raise ValueError(
                f"admit: {len(mpages)} mirror pages given for {n} chunks (expected {self.layout.pages_for(max(n, 1))})"
            )
        if not 1 <= n <= self.cfg.max_chunks:
            raise OffloadCapacityError(f"admit: {n} prefill chunks outside [1, max_chunks={self.cfg.max_chunks}]")
        if not 0 <= row < self.cfg.max_rows:
            raise IndexError(f"admit: row {row} outside [0, {self.cfg.max_rows})")
        with self.lock:
            if self.rows[row] is not None:
                raise RuntimeError(f"admit: row {row} is busy with request {self.rows[row].rid!r}; finish it first")
            mpages = self.mirror.alloc(self.layout.pages_for(n)) if mpages is None else self.mirror.claim(list(mpages))
            self._gen += 1
            st = RowState(
                rid=rid if rid is not None else f"row{row}/gen{self._gen}",
                gen=self._gen,
                mpages=mpages,
                n_chunks=n,
                ring=[-1] * self.cfg.decode_pages,
            )
            m = self._mchunks(st, 0, n)
            if kv is not None:  # device rows reach the mirror without a host wait (`landing`)
                self._stage_land(row, st, m, kv, index)
            elif index is not None:
                self.mirror.write_index(m, index)
            if index is not None:
                self.target.write(m, index)
            with self.on_main_stream():
                for mp in mpages:  # freed pages are already clear; this keeps a reused page clean by construction
                    self.lut.clear_page(mp)
                self.lut.row_pages[row].fill_(-1)
                self.lut.row_pages[row, : len(mpages)] = streams.like(
                    torch.tensor(mpages, dtype=torch.int32), self.lut.row_pages
                )
            self.rows[row] = st
            self.stats.per_req[st.rid]  # register the request in the metrics
            self.tables.rebuild([row])
            return st.gen

    def decode_append(
        self,
        rows: Sequence[int] | torch.Tensor,
        kv: torch.Tensor | None,
        index: torch.Tensor | None,
        valid: Sequence[bool] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append one decode chunk per valid batch row. rows: [B] (-1 = padding); kv/index: [n_layers, B, bytes].

        The chunk goes to the mirror and to its page's reserve block: the page's recall block if it is resident,
        else a block of the row's decode region (opened by copying the page from the mirror, so a partial
        prefill page is complete there). Padding rows write the sink cell. Returns int64 [B] cells written.
        kv=None / index=None: only assign cells and publish them; the caller writes those bytes itself (sglang's
        store kernel writes the cell, and the mirror is settled from it after the step).
        """
        rows_l = [int(r) for r in (rows.tolist() if torch.is_tensor(rows) else rows)]
        b = len(rows_l)
        if kv is not None:
            self._check_chunks("decode kv", kv, b, self.layout.kv.chunk_bytes)
        if index is not None:
            self._check_chunks("decode index", index, b, self.layout.index.chunk_bytes)
        ok = [r >= 0 for r in rows_l] if valid is None else [bool(v) and r >= 0 for v, r in zip(list(valid), rows_l)]
        live = [r for r, v in zip(rows_l, ok) if v]
        if len(set(live)) != len(live):
            raise ValueError(f"decode_append: a row appears twice in one step: {rows_l}")
        pc = self.layout.page_chunks
        with self.lock:
            sts = {r: self._live(r) for r in live}
            for r, st in sts.items():
                if st.n_chunks >= self.cfg.max_chunks:
                    raise OffloadCapacityError(f"row {r}: history reached max_chunks={self.cfg.max_chunks}")
                if st.n_chunks // pc == len(st.mpages):
                    st.mpages += self.mirror.alloc(1)
                    with self.on_main_stream():
                        self.lut.row_pages[r, len(st.mpages) - 1] = st.mpages[-1]
            idx = [i for i in range(b) if ok[i]]
            m = torch.tensor(
                [sts[rows_l[i]].mpages[sts[rows_l[i]].n_chunks // pc] * pc + sts[rows_l[i]].n_chunks % pc for i in idx],
                dtype=torch.int64,
            )
            if idx and kv is not None:  # the mirror first: opening a decode page copies the page, new chunk included
                self.mirror.write(m, kv[:, idx], None if index is None else index[:, idx])
            elif idx and index is not None:
                self.mirror.write_index(m, index[:, idx])
            if idx and index is not None:
                self.target.write(m, index[:, idx])
            cells = torch.full((b,), self.reserve.sink_cell, dtype=torch.int64)
            with self.on_main_stream():
                for i in idx:
                    r = rows_l[i]
                    st = sts[r]
                    p = st.n_chunks // pc
                    blk = st.recall.get(p)
                    if blk is None:
                        blk = self._ring_block(r, st, p)
                    cells[i] = blk * pc + st.n_chunks % pc
                if kv is not None:
                    self.reserve.write_cells(cells, kv, index)
                if idx:  # publish last: the entries appear once the bytes are in place
                    self.lut.set(m, cells[idx])
            for r, st in sts.items():
                st.n_chunks += 1
                self.stats.add(st.rid, "decode_chunks")
                self.stats.residency.append(r)  # the chunk landed in a resident page (recall block or decode slot)
            return cells

    def land(self, row: int, st: RowState, m: torch.Tensor, kv: torch.Tensor, index: torch.Tensor | None) -> None:
        """An admission's chunk rows at mirror chunks m [n] go to the mirror (the disk tier's window overrides it)."""
        self.mirror.write(m, kv, index)

    def add_pages(self, row: int, mpages: Sequence[int]) -> None:
        """Claim mirror pages and append them to the row's logical pages (for callers that own the page ids:
        the next `decode_append` crossing a page boundary uses them instead of allocating)."""
        with self.lock:
            st = self._live(row)
            if len(st.mpages) + len(mpages) > self.max_pages:
                raise OffloadCapacityError(
                    f"row {row}: {len(st.mpages) + len(mpages)} pages exceed max_chunks={self.cfg.max_chunks}"
                )
            got = self.mirror.claim(list(mpages))
            with self.on_main_stream():
                self.lut.row_pages[row, len(st.mpages) : len(st.mpages) + len(got)] = streams.like(
                    torch.tensor(got, dtype=torch.int32), self.lut.row_pages
                )
            st.mpages += got

    def open_tail_page(self, row: int) -> None:
        """Make the page holding the row's newest chunk resident now (a decode-region block), so Level 2 can read
        it before the first decode append or Level-1 cycle. No-op if it already is."""
        with self.lock:
            st = self._live(row)
            page = (st.n_chunks - 1) // self.layout.page_chunks
            if page not in st.recall and page not in st.ring:
                with self.on_main_stream():
                    self._ring_block(row, st, page, upto=st.n_chunks)

    def _ring_block(self, row: int, st: RowState, page: int, upto: int | None = None, src: Any = None) -> int:
        """Decode block of `page`, opened (copied from the mirror, or from src = (kv, index), the admission's rows
        on the device, `landing`) if needed. upto: chunks of the history to map, default n_chunks + 1 (the chunk
        being appended)."""
        if page in st.ring:
            return self.reserve.decode_block(row, st.ring.index(page))
        slot = st.ring_next
        if st.ring[slot] >= 0:
            self._retire(row, st, slot)
        blk = self.reserve.decode_block(row, slot)
        mp = st.mpages[page]
        upto = st.n_chunks + 1 if upto is None else upto
        c0 = page * self.layout.page_chunks
        if src is not None and st.n_chunks > c0:  # the admission's rows: device to device
            self.write_pages([blk], [c0], min(self.layout.page_chunks, st.n_chunks - c0), *src)
        elif st.n_chunks > c0:  # chunks of it are in the mirror only: copy the page up
            srow = self.mirror.rows(torch.tensor([mp]))  # the page's DRAM row (its id without a window)
            self.reserve.kv[:, blk] = streams.like(self.mirror.kv[:, srow], self.reserve.kv)[:, 0]
            if self.reserve.index.shape[0]:
                self.reserve.index[:, blk] = streams.like(self.mirror.index[:, srow], self.reserve.index)[:, 0]
        # else a fresh page: its first chunk is the one being appended, written into the block by its store
        st.ring[slot] = page
        st.ring_next = (slot + 1) % len(st.ring)
        self.lut.set_range(
            mp, 0, min(self.layout.page_chunks, upto - page * self.layout.page_chunks), blk * self.layout.page_chunks
        )
        self.stats.add(st.rid, "decode_page_opens")
        self.tables.rebuild([row])
        return blk

    def _retire(self, row: int, st: RowState, slot: int) -> None:
        """Free a decode slot. Its page is full (ring pages open in order), so it moves to a free recall block if
        the request is under its cap; otherwise it just stops being resident (still in the mirror)."""
        page = st.ring[slot]
        mp = st.mpages[page]
        nb = self.blocks.pop() if len(st.recall) < self.cfg.max_resident_pages else None
        if nb is not None:
            self.reserve.copy_block(self.reserve.decode_block(row, slot), nb)
            self.owner[nb] = (row, st.gen, page)
            st.recall[page] = nb
            self.lru.touch(nb)
            self.lut.set_range(mp, 0, self.layout.page_chunks, nb * self.layout.page_chunks)
            self.stats.add(st.rid, "decode_promotions")
        else:
            self.lut.clear_page(mp)
            self.stats.add(st.rid, "decode_spills")
        st.ring[slot] = -1

    def finish(self, row: int) -> None:
        """Release a request: recall blocks back to the free list, table entries cleared, mirror pages freed.
        A recall still in flight for it is discarded when it publishes (its blocks are freed then)."""
        with self.lock:
            st = self._live(row)
            with self.on_main_stream():
                for blk in st.recall.values():
                    self.lru.remove(blk)
                    self.owner[blk] = None
                    self.blocks.push(blk)
                for mp in st.mpages:
                    self.lut.clear_page(mp)
                self.lut.row_pages[row].fill_(-1)
            self.drop_lands(row)
            self.mirror.free(st.mpages)
            self.rows[row] = None
            self.tables.rebuild([row])
            self.stats.retire(st.rid)
