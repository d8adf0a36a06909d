"""`RecallPlanner`: the plan step of a page recall, mixed into `recall.Recaller` (read recall.py's module doc).

For each request's selection, under the engine lock in slices between two forwards: pages already resident are
touched in the LRU, the request's own stale pages are evicted first when it would exceed its cap, and each missing
page takes a free recall block, else the least-recently-used block whose page no live request selects. Victims
leave the lookup table before their bytes are overwritten; planned blocks are "in flight".
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from flashmemory.offload.lru import PAGE_SCAN_PAUSE, PAUSE
from flashmemory.offload.recall_types import RecallPlan, RecallRequest, RecallState


class RecallPlanner:
    """Mixed into `Recaller`: `state` is its `RecallState`, `slice_pages` its slice budget."""

    state: RecallState
    slice_pages: int

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
        plan = RecallPlan(
            t0=time.perf_counter(), cycle=tuple((rq.row, rq.gen) for rq in requests) if count_cycle else ()
        )
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
