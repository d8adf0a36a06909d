"""Level-1 page recall, executed by a `Recaller`: plan (under the lock; recall_plan.py), copy (no lock), publish
(under the lock).

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
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch

from flashmemory.offload.gather import gather_copy, keep_staging
from flashmemory.offload.recall_plan import RecallPlanner
from flashmemory.offload.recall_types import PageSource, RecallPlan, RecallRequest, RecallState

SLICE_PAGES = 512  # default `Recaller.slice_pages`


class Recaller(RecallPlanner):
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
            self.state.before_read({e[0] for e in plan.entries}, {e[3] for e in plan.entries})
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
                    for row, gen in plan.cycle:  # with its last slice: decode sees the pages and the flag together
                        st = self.state.rows[row]
                        if st is not None and st.gen == gen:
                            st.planned = True
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
