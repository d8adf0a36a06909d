"""Admissions whose chunk rows are already on the core's device (copy mode reads a new request's history from
sglang's device pool): their warm start copies from those rows, and their host-mirror copy travels without a
host wait. Mixed into `OffloadEngine` (engine.py); `sync_batch` takes this path for an admission whose `kv`
lives where the reserve does.

warm     The request's newest page (a decode block) and its older warm pages (recall blocks, planned as any warm
         start) are written from the admission's own rows, device to device, on the forward stream, before the
         forward that first decodes the request. Nothing crosses the host link, so these pages are not held to
         `EngineConfig.warm_step_pages`, and the request's first decode step attends its whole warm set: the pages
         are in the tables and the forward stream orders their bytes before it, nothing is missing.
land     The same rows go to the host mirror through page-locked staging (a non_blocking copy on the forward
         stream and an event: `_stage_land`). `apply_lands`, at the start of each `sync_batch`, writes a land into
         the mirror once its copy is complete (`done.query()`), and waits for one still pending after
         `STAGED_STEPS` steps. Nothing reads a row's mirror pages before its land is applied: a recall copy
         (Level 1's worker, the disk tier's `copy_plan`) first waits for and applies the lands of its rows
         (`ensure_landed`, the worker's wait, never the decode thread's in practice: lands are complete and applied
         a step after they are staged); the disk tier seals a row only once it has landed; `check_invariants`
         applies every land first. A land whose request finished (or whose row was reused) is dropped.
settle   Copy mode's chunks closed by the last forward (sglang's pool holds their bytes from then on) travel the
         same way (`stage_chunks`): gathered on the device, written there into their resident cells and the
         target index pool, and staged for the mirror as one pinned copy and event, with one `PendingLand` per row
         (a view of that copy), applied, waited for and dropped as an admission's land is.
Without streams (CPU) the rows are written into the mirror at once: there is nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flashmemory.offload import streams
from flashmemory.offload.recall_types import RecallRequest

if TYPE_CHECKING:
    from flashmemory.offload.layout import OffloadLayout
    from flashmemory.offload.lut import ChunkLUT
    from flashmemory.offload.mirror import HostMirror
    from flashmemory.offload.recall import Recaller
    from flashmemory.offload.reserve import DeviceReserve, TargetIndexPool
    from flashmemory.offload.rows import RowState
    from flashmemory.offload.streams import ForwardOrder

STAGED_STEPS = 3  # `sync_batch` calls a land may stay pending before `apply_lands` waits for it


@dataclass(eq=False)
class PendingLand:
    """An admission's rows on their way to the host mirror: engine row and generation, mirror chunks m int64 [n]
    (host), kv uint8 [n_layers, n, kv_chunk_bytes] and index uint8 [n_layers, n, index_chunk_bytes] (or None) in
    pinned host buffers filled by a device copy that `done` (a CUDA event) marks complete; age: `apply_lands`
    calls it has waited through. A settle (`stage_chunks`) holds only the Path-I layers' index-K
    [n_path_i_layers, n, index_chunk_bytes] and is written into the mirror as it is (never the tier's landing
    window: its chunks are a live row's newest)."""

    row: int
    gen: int
    m: torch.Tensor
    kv: torch.Tensor
    index: torch.Tensor | None
    done: Any
    age: int = 0
    settle: bool = False


class DeviceLanding:
    """Mixed into `OffloadEngine`; the attributes below are the engine's (built in its constructor)."""

    layout: OffloadLayout
    reserve: DeviceReserve
    lut: ChunkLUT
    mirror: HostMirror
    target: TargetIndexPool
    order: ForwardOrder
    recaller: Recaller
    rows: list[RowState | None]
    lands: list[PendingLand]
    lock: Any

    _live: Callable[[int], RowState]  # engine.py
    _ring_block: Callable[..., int]  # engine.py: (row, st, page, upto=None, src=None) -> reserve block
    land: Callable[[int, RowState, torch.Tensor, torch.Tensor, torch.Tensor | None], None]  # engine.py, disk tier

    def near(self, t: torch.Tensor | None) -> bool:
        """Whether chunk rows `t` live where the reserve does (device rows for a device reserve; any rows on CPU):
        an admission of such rows warms from them (`warm_from_rows`)."""
        return t is not None and streams.is_device(t) == streams.is_device(self.reserve.kv)

    # ---- the mirror copy ---------------------------------------------------------------------------
    def _stage_land(self, row: int, st: RowState, m: torch.Tensor, kv: torch.Tensor, index: Any) -> None:
        """Inside `admit` (lock held): device rows kv / index of mirror chunks m [n] start for the mirror (see
        the module doc); without streams, or from host rows, they are written now (`land`)."""
        if not (self.order.enabled and streams.is_device(kv)):
            self.land(row, st, m, kv.cpu(), None if index is None else index.cpu())
            return
        with self.order.on_stream():
            kv_h, ix_h = streams.download(kv), streams.download(index)
            done = torch.cuda.Event()
            done.record(self.order.stream)
        self.lands.append(PendingLand(row, st.gen, m.cpu().long(), kv_h, ix_h, done))

    def _land_now(self, p: PendingLand) -> None:
        """Write a complete land into the mirror (lock held); dropped if its request is gone."""
        st = self.rows[p.row]
        if st is None or st.gen != p.gen:
            return
        if p.settle:
            self._write_settle(p.m, p.kv, p.index)
        else:
            self.land(p.row, st, p.m, p.kv, p.index)

    def _write_settle(self, m: torch.Tensor, kv: torch.Tensor, index: torch.Tensor | None) -> None:
        """Host chunk rows of mirror chunks m [n] into the mirror (lock held): kv of every layer, index of the
        Path-I layers."""
        pc = self.layout.page_chunks
        mr = self.mirror.rows(m // pc, write=True)
        self.layout.kv.write_chunks(self.mirror.kv, mr, m % pc, kv)
        if index is not None:
            self.layout.index.write_chunks(self.mirror.index, mr, m % pc, index)

    def stage_chunks(
        self, rows: Sequence[int], m: torch.Tensor, kv: torch.Tensor, index: Sequence[torch.Tensor | None]
    ) -> None:
        """`store_chunks` of every c4 layer without a host wait (copy mode's settle, see the module doc): chunk rows
        the caller's device storage holds for mirror chunks m [n] (host int64) of engine rows `rows` [n]: kv uint8
        [n_layers, n, kv_chunk_bytes] and index[l] uint8 [n, index_chunk_bytes] of c4 layer l (the target and
        Path-I layers; None elsewhere), both where the reserve lives. On the forward stream they go into the cell
        each chunk is resident in now (the sink cell otherwise: no mask read by the host) and the target index
        pool; the mirror gets them once their pinned copy is complete (`apply_lands`)."""
        if not len(rows):
            return
        lay, pc = self.layout, self.layout.page_chunks
        staged = self.order.enabled and streams.is_device(kv)
        rs, m, ix = list(rows), m.long(), list(index)
        with self.lock, self.order.on_stream():
            if staged:  # each row's chunks side by side: one view of the pinned copy each
                order = sorted(range(len(rows)), key=lambda i: rows[i])
                rs, o = [rows[i] for i in order], torch.tensor(order, dtype=torch.int64)
                m, od = m[o], streams.like(o, kv)
                kv = kv.index_select(1, od)
                ix = [None if t is None else t.index_select(0, od) for t in ix]
            md = streams.like(m, self.lut.table)
            now = self.lut.table[md].long()
            dst = torch.where(now >= 0, now, torch.full_like(now, self.reserve.sink_cell))
            lay.kv.write_chunks(self.reserve.kv, dst // pc, dst % pc, kv)
            for l in lay.target_layers:
                if ix[l] is not None:
                    buf = self.target.pages[self.target.layers.index(l)]
                    mb = streams.like(md, buf)
                    lay.index.write_chunks(buf, mb // pc, mb % pc, ix[l])
            pix = None
            if lay.offload_index_layers and all(ix[l] is not None for l in lay.offload_index_layers):
                pix = torch.stack([ix[l] for l in lay.offload_index_layers])
                if self.reserve.index.shape[0]:
                    lay.index.write_chunks(self.reserve.index, dst // pc, dst % pc, pix)
            if staged:
                kv_h, ix_h = streams.download(kv), streams.download(pix)
                done = torch.cuda.Event()
                done.record(self.order.stream)
            else:  # nothing to wait for: one write of the chunks of live rows
                live = torch.tensor([self.rows[r] is not None for r in rs], dtype=torch.bool)
                ixs = None if pix is None else pix.cpu()[:, live]
                self._write_settle(m[live], kv.cpu()[:, live], ixs)
                return
            a = 0
            while a < len(rs):
                b = a + 1
                while b < len(rs) and rs[b] == rs[a]:
                    b += 1
                st = self.rows[rs[a]]
                if st is not None:
                    ixa = None if ix_h is None else ix_h[:, a:b]
                    self.lands.append(PendingLand(rs[a], st.gen, m[a:b], kv_h[:, a:b], ixa, done, settle=True))
                a = b

    def apply_lands(self, wait_after: int = STAGED_STEPS) -> int:
        """Decode thread, at the start of a step: write the lands whose copies are complete into the mirror; one
        pending for `wait_after` calls is waited for (a host sync; under the overlap scheduler its copy finished
        long before). Returns the lands applied."""
        with self.lock:
            if not self.lands:
                return 0
            left, n = [], 0
            for p in self.lands:
                p.age += 1
                if not p.done.query():
                    if p.age < wait_after:
                        left.append(p)
                        continue
                    p.done.synchronize()
                self._land_now(p)
                n += 1
            self.lands[:] = left
            return n

    def ensure_landed(self, rows: Iterable[int], mpages: Iterable[int] | None = None) -> None:
        """Before reading the mirror pages of `rows` (any thread, lock not held): wait for their pending lands and
        apply them. A no-op when none is pending (the usual case: lands are applied a step after admission).
        mpages: the mirror pages the reader reads; a settle of chunks on none of them is left pending (a recall
        reads older pages than the newest one, where a settle's chunks usually are)."""
        want = set(rows)
        pages = None if mpages is None else {int(x) for x in mpages}
        pc = self.layout.page_chunks
        with self.lock:
            mine = [
                p
                for p in self.lands
                if p.row in want and (not p.settle or pages is None or any(int(c) // pc in pages for c in p.m.tolist()))
            ]
        if not mine:
            return
        for p in mine:
            p.done.synchronize()  # outside the lock: decode keeps running meanwhile
        with self.lock:
            for p in mine:
                if p in self.lands:
                    self.lands.remove(p)
                    self._land_now(p)

    def landing_rows(self) -> set[int]:
        """Rows whose admission has not reached the mirror yet (read under the lock)."""
        with self.lock:
            return {p.row for p in self.lands}

    def flush_lands(self) -> None:
        """Wait for and apply every pending land (tests, checks, shutdown)."""
        self.ensure_landed([p.row for p in list(self.lands)])

    def drop_lands(self, row: int) -> None:
        """The request in `row` finishes (lock held): its pending lands are dropped."""
        self.lands[:] = [p for p in self.lands if p.row != row]

    # ---- the warm start ---------------------------------------------------------------------------
    def warm_from_rows(self, row: int, kmax: int, kv: torch.Tensor, index: torch.Tensor | None) -> int:
        """A new row's newest page and its older pages up to `kmax` in all, written from its admission rows kv /
        index (uint8 [n_layers, n_chunks, chunk bytes], where the reserve lives) on the forward stream; no host
        wait, no read of the mirror. Returns the older pages published (counted as warm_start_pages)."""
        pc = self.layout.page_chunks
        with self.lock:
            st = self._live(row)
            gen, n = st.gen, st.n_chunks
            tail = (n - 1) // pc
            if tail not in st.recall and tail not in st.ring:
                with self.order.on_stream():
                    self._ring_block(row, st, tail, upto=n, src=(kv, index))
        older = tuple(range(max(0, tail + 1 - kmax), tail))
        if not older:
            return 0
        req = RecallRequest(row=row, gen=gen, pages=older, priority=tuple(float(p) for p in older))
        plan = self.recaller.plan([req], count_cycle=False)
        if plan.entries:
            with self.order.on_stream():  # after every forward that may read a victim's old bytes
                self.write_pages([e[4] for e in plan.entries], [e[2] * pc for e in plan.entries], pc, kv, index)
            plan.nbytes = len(plan.entries) * (
                self.reserve.kv.shape[0] * self.reserve.kv.shape[2]
                + self.reserve.index.shape[0] * self.reserve.index.shape[2]
            )
        return self.recaller.publish(plan, also_count="warm_start_pages")

    def write_pages(
        self, blocks: list[int], starts: list[int], count: int, kv: torch.Tensor, index: torch.Tensor | None
    ) -> None:
        """reserve block blocks[i] <- chunks [starts[i], starts[i] + count) of rows kv [n_layers, n, kv_chunk_bytes]
        (and the Path-I layers of index [n_layers, n, index_chunk_bytes]), at offsets 0.. of the block; on the
        current stream, index tensors staged through pinned memory (no host wait)."""
        j = torch.cat([torch.arange(s, s + count) for s in starts])
        dst = torch.tensor(blocks, dtype=torch.int64).repeat_interleave(count)
        offs = torch.arange(count).repeat(len(blocks))
        dd, od = streams.like(dst, self.reserve.kv), streams.like(offs, self.reserve.kv)
        self.layout.kv.write_chunks(self.reserve.kv, dd, od, kv.index_select(1, streams.like(j, kv)))
        ol = self.layout.offload_index_layers
        if self.reserve.index.shape[0] and index is not None:
            sel = index.index_select(0, streams.like(torch.tensor(ol, dtype=torch.int64), index))
            self.layout.index.write_chunks(self.reserve.index, dd, od, sel.index_select(1, streams.like(j, index)))
