"""Level-1 page recall, executed by a `Recaller`: plan (under the lock), copy (no lock), publish (under the lock).

The engine builds one `Recaller` over one `RecallState` (`recall_types`: the parts recall touches) and exposes
it as `engine.recaller`; Level 1 (`flashmemory.residency.level1`) computes `RecallRequest`s without the lock and
hands them over. This module imports no engine (the engine imports it), nor another module's private names.

plan     For each request's selection: pages already resident are touched in the LRU; the request's own stale
         pages are evicted first when it would exceed its cap; each missing page takes a free recall block,
         else the least-recently-used block whose page no live request currently selects. Missing pages are
         served in priority order (recency tail first, then by score), so when the reserve runs out the
         lowest-scoring pages are the ones dropped, and each drop is counted. Victims leave the lookup table
         here, before their bytes are overwritten. Planned blocks are "in flight": owned, not free, not mapped.
copy     One gather per layer group (c4 KV, Path-I index-K) from the mirror into a staging tensor, then one
         indexed copy into the reserve (a side CUDA stream when there is one, after the forward stream: every
         forward that may read a victim's old bytes; the worker waits for the copy).
publish  Lookup-table entries are written only now. A page whose request finished, whose row was reused
         (generation changed), or which decode mapped in the meantime is discarded and its block freed.
Plan and publish write the tables between two forwards, on the forward stream handed in for the current step
(`flashmemory.offload.streams.ForwardOrder.between_forwards`), taking the forward gate before the engine lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from flashmemory.offload.gather import gather_copy, keep_staging
from flashmemory.offload.lru import PAGE_SCAN_PAUSE, PAUSE
from flashmemory.offload.recall_types import PageSource, RecallPlan, RecallRequest, RecallState

SLICE_PAGES = 512  # default `Recaller.slice_pages`


class Recaller:
    """Plans, copies, publishes and cancels page recalls over the engine's shared state (see the module doc).

    state: the engine's parts recall works on (`RecallState`, owned by the engine, shared by reference);
    `state.lock` guards all of them; `copy_lock` serialises copies (they own `staging`).
    """

    def __init__(self, state: RecallState):
        self.state = state
        self.copy_lock = threading.Lock()  # one recall copy at a time: it owns the staging buffers
        self.staging: dict[str, torch.Tensor] = {}  # reusable (pinned on CUDA) staging, grown on demand
        self.copy_hook: Callable[[], None] | None = None  # called between the KV and index copies (tests)
        # Copies plans itself when set (the disk tier: sealed pages come from its host cache / disk, not the mirror).
        self.source: PageSource | None = None
        # Pages handled per engine-lock hold by plan and publish: bounds how long decode can wait for a cycle.
        self.slice_pages = SLICE_PAGES

    @property
    def lock(self) -> Any:
        """The engine's lock (`state.lock`: the engine may swap it, the recaller always takes the current one)."""
        return self.state.lock

    @property
    def main_stream(self) -> Any:
        """The forward stream as last handed in (None without streams)."""
        return self.state.order.stream

    @property
    def side_stream(self) -> Any:
        return self.state.order.side

    def _evict(self, blk: int, touched: set[int], cleared: list[int]) -> None:
        """Drop a published page from its request; its mirror page goes to `cleared` for one batched clear."""
        row, _, page = self.state.owner[blk]
        st = self.state.rows[row]
        del st.recall[page]
        cleared.append(st.mpages[page])
        self.state.lru.remove(blk)
        self.state.owner[blk] = None
        self.state.stats.add(st.rid, "evictions")
        touched.add(row)

    def plan(self, requests: Sequence[RecallRequest], count_cycle: bool = True) -> RecallPlan:
        """Choose a block for each missing page and evict what must go (see the module doc).

        Ranking needs no engine state and runs before the lock. The rest runs in two passes, each in slices of
        about `slice_pages` units of work (a page handled, or a resident-table slot rebuilt: a touched row costs
        the table's width), one engine-lock hold and one forward gap per slice, so decode never waits for a whole
        cycle's bookkeeping: (1) per request, its selection is set, its own stale pages are evicted and its
        missing pages listed (a request is never split: its eviction decisions are atomic with respect to
        decode); (2) the missing pages take free blocks, else LRU victims. Every slice clears its victims from
        the lookup table and rebuilds the touched resident tables before it releases the lock. Without
        concurrent callers the result equals one pass under one hold; with them, a request finished or replaced
        between the passes is skipped, and the victim scan keeps its LRU order from the start of pass 2 (a block
        touched since is judged by its current state, only its age is the older one)."""
        plan = RecallPlan(t0=time.perf_counter())
        need: list[tuple[int, int, int, float]] = []  # (row, gen, page, priority)
        # Order: (priority desc, page desc), duplicates merged; pages past the history are dropped under the lock.
        ranks = [
            sorted({p: q for p, q in zip(rq.pages, rq.priority) if p >= 0}.items(), key=lambda x: (-x[1], -x[0]))
            for rq in requests
        ]
        width = self.state.tables.res_cap
        i = 0
        while i < len(requests):
            with self._slice() as (touched, cleared):
                work = 0
                while i < len(requests) and (work == 0 or work + len(ranks[i]) + width <= self.slice_pages):
                    self._select(requests[i], ranks[i], count_cycle, need, touched, cleared)
                    work += len(ranks[i]) + width
                    i += 1
        victims: Iterator[int] | None = None
        k = 0
        while k < len(need):
            with self._slice() as (touched, cleared):
                if victims is None:
                    victims = self.state.lru.victims(self._evictable, PAGE_SCAN_PAUSE)
                k = self._assign(need, k, victims, plan, touched, cleared)
        return plan

    def _budget_left(self, done: int, rows: int) -> bool:
        """Whether a slice that handled `done` pages and may rebuild `rows` rows' tables takes one more page."""
        return done == 0 or done + rows * self.state.tables.res_cap < self.slice_pages

    @contextmanager
    def _slice(self) -> Iterator[tuple[set[int], list[int]]]:
        """One lock hold of a planning pass, between two forwards. Yields (rows touched, mirror pages of victims);
        on exit the victims leave the lookup table (also when an error propagates) and the rows' tables rebuild."""
        touched: set[int] = set()
        cleared: list[int] = []
        with self.state.order.between_forwards(), self.state.lock:
            try:
                yield touched, cleared
            finally:  # victims leave the table before their blocks are overwritten, and before any error propagates
                self.state.lut.clear_pages(cleared)
            self.state.tables.rebuild(touched)

    def _select(
        self,
        rq: RecallRequest,
        ranked: list[tuple[int, float]],
        count_cycle: bool,
        need: list[tuple[int, int, int, float]],
        touched: set[int],
        cleared: list[int],
    ) -> None:
        """Pass 1 for one request (under the lock): set its selection, evict its own stale pages down to its cap,
        append its missing pages to `need` in priority order (dropping, and counting, those over the cap)."""
        st = self.state.rows[rq.row] if 0 <= rq.row < len(self.state.rows) else None
        if st is None or st.gen != rq.gen:
            return  # finished or replaced before its cycle was planned
        if count_cycle:  # an admission warm start (`warm_start`) is not a cycle
            self.state.stats.add(st.rid, "cycles")
        pc = self.state.layout.page_chunks
        cap = min(self.state.max_resident_pages, rq.budget or self.state.max_resident_pages)
        n_pages = len(st.mpages)
        ranked = [x for x in ranked if x[0] < n_pages]
        if len(ranked) > cap:
            self.state.stats.add(st.rid, "budget_hits", len(ranked) - cap)
            self.state.stats.add(st.rid, "tail_drops", sum(q == float("inf") for _, q in ranked[cap:]))
            ranked = ranked[:cap]
        sel = {p for p, _ in ranked}
        st.selection = frozenset(sel)
        for p in sel & st.recall.keys():
            self.state.lru.touch(st.recall[p])
        missing = [(p, q) for p, q in ranked if p not in st.recall and p not in st.ring]
        # dict order = oldest recalled first. The page holding the newest chunk stays: decode writes its
        # next chunk there during the very forward a recall copy into a reused block could overlap.
        tip = (st.n_chunks - 1) // pc
        stale = [p for p in st.recall if p not in sel and p != tip]
        while stale and len(st.recall) + len(missing) > cap:
            blk = st.recall[stale.pop(0)]
            self._evict(blk, touched, cleared)
            self.state.blocks.push(blk)
        over = len(st.recall) + len(missing) - cap
        if over > 0:  # only the kept newest page is left to evict: the lowest-priority new pages give way
            self.state.stats.add(st.rid, "budget_hits", over)
            self.state.stats.add(st.rid, "tail_drops", sum(q == float("inf") for _, q in missing[-over:]))
            missing = missing[:-over]
        need += [(rq.row, rq.gen, p, q) for p, q in missing]

    def _evictable(self, blk: int) -> bool:
        """A published block whose page no live selection holds and which is not its request's newest page."""
        row, gen, page = self.state.owner[blk]
        st = self.state.rows[row]
        return (
            st is not None
            and st.gen == gen
            and page not in st.selection
            and page != (st.n_chunks - 1) // self.state.layout.page_chunks
        )

    def _assign(
        self,
        need: list[tuple[int, int, int, float]],
        k: int,
        victims: Iterator[int],
        plan: RecallPlan,
        touched: set[int],
        cleared: list[int],
    ) -> int:
        """Pass 2 from need[k] on, while this slice's budget lasts (under the lock): each page takes a free block,
        else the next LRU victim, else it is dropped (counted). Returns the next index. `victims` is
        `lru.victims(self._evictable, PAGE_SCAN_PAUSE)`, shared by the pass's slices: within one hold
        evictability is fixed (nothing else runs under the lock) and the LRU only loses the victims taken, so one
        forward scan yields the same victims as a fresh search per page. The scan pauses every PAGE_SCAN_PAUSE
        blocks (counted as a quarter unit each): a long search for a victim ends the slice and resumes in the
        next hold with the same page."""
        work = 0
        while k < len(need) and self._budget_left(work, len(touched) + 1):  # + a victim's row
            row, gen, page, prio = need[k]
            st = self.state.rows[row]
            if st is None or st.gen != gen or page in st.recall or page in st.ring:
                k, work = k + 1, work + 1
                continue  # finished, replaced or mapped by decode since pass 1
            blk = self.state.blocks.pop()
            victim = blk is None
            while blk is None:
                nxt = next(victims, None)
                if nxt is None:
                    break  # no block left to reclaim
                if nxt == PAUSE:
                    work += PAGE_SCAN_PAUSE // 4
                    if not self._budget_left(work, len(touched) + 1):
                        return k  # this page searches on in the next hold
                    continue
                blk = nxt
            k, work = k + 1, work + 1
            if blk is not None and victim:
                self._evict(blk, touched, cleared)
            if blk is None:  # reserve exhausted: degrade, lowest priority last in `need` order per request
                self.state.stats.add(st.rid, "budget_hits")
                if prio == float("inf"):
                    self.state.stats.add(st.rid, "tail_drops")
                continue
            self.state.owner[blk] = (row, gen, page)
            self.state.inflight.add(blk)
            plan.entries.append((row, gen, page, st.mpages[page], blk))
        return k

    def prefetch(self, requests: Sequence[RecallRequest]) -> int:
        """Start reading the requests' cold pages from a slower tier now (the source's `prefetch_requests`, when it
        has one: the disk tier), so the copy later finds them in host memory. Returns the reads queued."""
        fn = getattr(self.source, "prefetch_requests", None)
        return fn(requests) if fn is not None else 0

    def copy(self, plan: RecallPlan, wait: bool = True) -> None:
        """Copy the planned pages mirror -> reserve, without the engine lock: in-flight blocks are neither read
        nor written by anyone else. If the request finishes meanwhile its mirror pages may be reused and the copy
        reads mixed bytes; publish then sees the changed generation and discards them. wait=False (the decode
        thread: lockstep publishes, admission warm starts): the host does not wait for the device copy; it is
        staged in fresh pinned memory and `plan.ready` marks it, which the publish's stream waits on."""
        if not plan.entries:
            return
        if self.source is not None:
            self.source.copy_plan(plan, wait)
        else:
            self._copy_from_mirror(plan, wait)
        plan.nbytes = len(plan.entries) * (
            self.state.reserve.kv.shape[0] * self.state.reserve.kv.shape[2]
            + self.state.reserve.index.shape[0] * self.state.reserve.index.shape[2]
        )

    def _copy_from_mirror(self, plan: RecallPlan, wait: bool = True) -> None:
        if self.state.before_read is not None:
            self.state.before_read({e[0] for e in plan.entries})
        src = self.state.mirror.rows(torch.tensor([e[3] for e in plan.entries], dtype=torch.int64))  # ids -> DRAM rows
        dst = torch.tensor([e[4] for e in plan.entries], dtype=torch.int64)
        side = self.side_stream
        if not wait and side is not None:  # fresh staging: no copy_lock, so never behind the worker's host wait
            with self.state.order.copy_context():
                plan.staging.append(gather_copy(self.state.mirror.kv, self.state.reserve.kv, src, dst))
                if self.copy_hook is not None:
                    self.copy_hook()
                if self.state.reserve.index.shape[0]:
                    plan.staging.append(gather_copy(self.state.mirror.index, self.state.reserve.index, src, dst))
                plan.ready = torch.cuda.Event()
                plan.ready.record(side)
            return
        with self.copy_lock, self.state.order.copy_context():  # forwards that read the victims' old bytes finish first
            stage = gather_copy(self.state.mirror.kv, self.state.reserve.kv, src, dst, self.staging.get("kv"))
            keep_staging(self.staging, "kv", stage)
            if self.copy_hook is not None:
                self.copy_hook()
            if self.state.reserve.index.shape[0]:
                stage = gather_copy(
                    self.state.mirror.index, self.state.reserve.index, src, dst, self.staging.get("index")
                )
                keep_staging(self.staging, "index", stage)
            if side is not None:
                side.synchronize()  # the worker waits, not decode: bytes land before publish and before stage reuse

    def publish(self, plan: RecallPlan, also_count: str | None = None) -> int:
        """Write the lookup table for the copied pages (under the lock, in slices of about `slice_pages` units of
        work as `plan` counts them, one hold and one forward gap each); returns the pages published. also_count:
        a second counter the published pages are added to besides recall_pages (e.g. "warm_start_pages")."""
        per_page = plan.nbytes // max(1, len(plan.entries))
        done = k = 0
        while True:
            with self.state.order.between_forwards(), self.state.lock:
                if plan.ready is not None:  # an unwaited copy: the table writes queue behind it on the device
                    self.state.order.stream.wait_event(plan.ready)
                    plan.ready = None
                k, n = self._publish_slice(plan.entries, k, per_page, also_count)
                done += n
                if k >= len(plan.entries):
                    self.state.stats.cycle(done, plan.nbytes, time.perf_counter() - plan.t0)
                    break
        plan.staging.clear()
        return done

    def _publish_slice(
        self, entries: list[tuple[int, int, int, int, int]], k: int, per_page: int, also_count: str | None
    ) -> tuple[int, int]:
        """`publish` from entries[k] on while the slice's budget lasts (caller holds the gate and the lock);
        returns (next index, pages published)."""
        pc = self.state.layout.page_chunks
        published: dict[int, int] = {}  # row -> pages published
        mps: list[int] = []
        counts: list[int] = []
        cells: list[int] = []
        start = k
        while k < len(entries) and self._budget_left(k - start, len(published) + (entries[k][0] not in published)):
            row, gen, page, mp, blk = entries[k]
            k += 1
            self.state.inflight.discard(blk)
            st = self.state.rows[row]
            if st is None or st.gen != gen or page in st.recall or page in st.ring:
                self.state.owner[blk] = None
                self.state.blocks.push(blk)
                if st is not None and st.gen == gen:
                    self.state.stats.add(st.rid, "cancelled_pages")
                else:
                    self.state.stats.finished["cancelled_pages"] += 1
                continue
            st.recall[page] = blk
            self.state.lru.touch(blk)
            mps.append(mp)  # distinct: a second plan entry for the same page is discarded above
            counts.append(min(pc, st.n_chunks - page * pc))
            cells.append(blk * pc)
            published[row] = published.get(row, 0) + 1
        self.state.lut.set_pages(mps, counts, cells)
        for row, n in published.items():
            rid: Hashable = self.state.rows[row].rid
            self.state.stats.add(rid, "recall_pages", n)
            self.state.stats.add(rid, "recall_bytes", n * per_page)
            if also_count:
                self.state.stats.add(rid, also_count, n)
        self.state.tables.rebuild(published)
        return k, len(mps)

    def cancel(self, plan: RecallPlan) -> None:
        """Give back a plan's in-flight blocks without publishing anything (the copy failed)."""
        with self.state.lock:
            for *_, blk in plan.entries:
                self.state.inflight.discard(blk)
                self.state.owner[blk] = None
                self.state.blocks.push(blk)
            self.state.stats.finished["cancelled_pages"] += len(plan.entries)
        plan.entries.clear()
        plan.staging.clear()

    def recall(
        self,
        requests: Sequence[RecallRequest],
        count_cycle: bool = True,
        also_count: str | None = None,
        wait: bool = True,
    ) -> int:
        """Plan, copy (cancelled if it fails, then re-raised) and publish; returns the pages published. wait=False:
        the host never waits for the copy (see `copy`); the published entries are read only after it lands."""
        plan = self.plan(requests, count_cycle=count_cycle)
        try:
            self.copy(plan, wait)
        except BaseException:
            self.cancel(plan)  # blocks back to the free list, nothing published
            raise
        done = self.publish(plan, also_count=also_count)
        if plan.error is not None:  # the other requests' pages are published; this one's failure goes up now
            raise plan.error
        return done

    def warm_start(self, row: int, kmax: int, wait: bool = True) -> int:
        """Recall a newly admitted row's newest kmax history pages before its first decode step (the newest page
        itself is already held by the engine's `open_tail_page`, so at most kmax - 1 are copied). wait=False (the
        decode thread, `OffloadEngine.sync_batch`): the copy is not waited for on the host; the first forward's
        stream waits for it (`copy`).

        Why: a request's first Level-1 cycle comes only after its first decode forward (up to tau steps later with
        a stagger); until then it would decode with its newest page alone, so even a budget that holds the whole
        history would differ from Full attention on those steps. The first cycle re-plans from this recency set.
        Returns the pages published (counted as warm_start_pages, not as a Level-1 cycle). Raises KeyError if
        the row holds no request."""
        with self.state.lock:
            st = self.state.rows[row]
            if st is None:
                raise KeyError(f"row {row} holds no request (admit it first)")
            gen, n_pages = st.gen, -(-st.n_chunks // self.state.layout.page_chunks)
        older = tuple(range(max(0, n_pages - kmax), n_pages - 1))
        if not older:
            return 0
        req = RecallRequest(row=row, gen=gen, pages=older, priority=tuple(float(p) for p in older))
        plan = self.plan([req], count_cycle=False)
        self.copy(plan, wait)
        done = self.publish(plan, also_count="warm_start_pages")
        if plan.error is not None:
            raise plan.error
        return done


class HasRecaller(Protocol):
    """Anything that exposes a `Recaller` (the engine); the free functions below take it."""

    recaller: Recaller


def plan_recall(eng: HasRecaller, requests: Sequence[RecallRequest], count_cycle: bool = True) -> RecallPlan:
    """`eng.recaller.plan` (kept for benches, scripts and tests)."""
    return eng.recaller.plan(requests, count_cycle)


def execute_recall(eng: HasRecaller, plan: RecallPlan) -> None:
    """`eng.recaller.copy`."""
    eng.recaller.copy(plan)


def publish_recall(eng: HasRecaller, plan: RecallPlan, also_count: str | None = None) -> int:
    """`eng.recaller.publish`."""
    return eng.recaller.publish(plan, also_count)


def recall_now(eng: HasRecaller, requests: Sequence[RecallRequest]) -> RecallPlan:
    """Plan, copy and publish in one call (synchronous; tests, benches and warm starts)."""
    plan = plan_recall(eng, requests)
    execute_recall(eng, plan)
    publish_recall(eng, plan)
    return plan
