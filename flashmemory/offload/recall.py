"""Level-1 page recall: plan (under the lock), copy (no lock), publish (under the lock).

plan     For each request's selection: pages already resident are touched in the LRU; the request's own stale
         pages are evicted first when it would exceed its cap; each missing page takes a free recall block,
         else the least-recently-used block whose page no live request currently selects. Missing pages are
         served in priority order (recency tail first, then by score), so when the reserve runs out the
         lowest-scoring pages are the ones dropped, and each drop is counted. Victims leave the lookup table
         here, before their bytes are overwritten. Planned blocks are "in flight": owned, not free, not mapped.
copy     One gather per layer group (c4 KV, Path-I index-K) from the mirror into a staging tensor, then one
         indexed copy into the reserve (a side CUDA stream when there is one; the worker waits for it).
publish  Lookup-table entries are written only now. A page whose request finished, whose row was reused
         (generation changed), or which decode mapped in the meantime is discarded and its block freed.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from flashmemory.offload.engine import OffloadEngine


@dataclass(frozen=True)
class RecallRequest:
    """One request's Level-1 result. pages: logical pages; priority: same length, higher = keep first
    (use +inf for the recency tail). budget: this request's page cap for this cycle (escalation widens and
    shrinks it), at most the engine's `max_resident_pages`; None = the engine's cap. Recalled pages beyond it
    that the selection no longer holds are evicted, so a shrunk budget really gives its blocks back."""

    row: int
    gen: int
    pages: tuple[int, ...]
    priority: tuple[float, ...]
    budget: int | None = None

    def __post_init__(self) -> None:
        if len(self.pages) != len(self.priority):
            raise ValueError(f"RecallRequest(row={self.row}): {len(self.pages)} pages but {len(self.priority)} priorities")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"RecallRequest(row={self.row}): budget must be >= 1, got {self.budget}")


@dataclass
class RecallPlan:
    """entries: (row, gen, page, mirror page, block) to copy. Filled by `plan_recall`."""

    entries: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    t0: float = 0.0
    nbytes: int = 0
    staging: list[torch.Tensor] = field(default_factory=list)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed with the widest integer dtype dividing the row: indexed copies move whole words."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[-1] % size == 0:
            return t.view(dt)
    return t


def gather_copy(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                stage: torch.Tensor | None = None) -> torch.Tensor:
    """dst[:, dst_idx] = src[:, src_idx] with one gather and one copy. src: [L, P, W] host; dst: [L, NB, W].

    stage: optional reusable buffer with at least L*K*W bytes (pinned for an async H2D copy). Returns the
    staging tensor [L, K, W], which must live until the copy completes.
    """
    shape = (src.shape[0], src_idx.numel(), src.shape[2])
    n = shape[0] * shape[1] * shape[2]
    if stage is None or stage.numel() < n:
        stage = torch.empty(n, dtype=src.dtype, pin_memory=src.is_pinned() and dst.is_cuda)
    stage = stage[:n].view(shape)
    torch.index_select(src, 1, src_idx, out=stage)
    _wide(dst).index_copy_(1, dst_idx.to(dst.device), _wide(stage.to(dst.device, non_blocking=stage.is_pinned())))
    return stage


def page_by_page_copy(src: torch.Tensor, dst: torch.Tensor, src_idx: list[int], dst_idx: list[int]) -> None:
    """The baseline `gather_copy` is measured against: one copy per (layer, page)."""
    for layer in range(src.shape[0]):
        for s, d in zip(src_idx, dst_idx):
            dst[layer, d].copy_(src[layer, s])


def _evict(eng: "OffloadEngine", blk: int, touched: set[int], cleared: list[int]) -> None:
    """Drop a published page from its request; its mirror page is appended to `cleared` for one batched clear."""
    row, _, page = eng.owner[blk]
    st = eng.rows[row]
    del st.recall[page]
    cleared.append(st.mpages[page])
    eng.lru.remove(blk)
    eng.owner[blk] = None
    eng.stats.add(st.rid, "evictions")
    touched.add(row)


def plan_recall(eng: "OffloadEngine", requests: Sequence[RecallRequest], count_cycle: bool = True) -> RecallPlan:
    plan = RecallPlan(t0=time.perf_counter())
    pc = eng.layout.page_chunks
    touched: set[int] = set()
    cleared: list[int] = []  # mirror pages of evicted pages, cleared from the table before the lock is released
    need: list[tuple[int, int, int, float]] = []  # (row, gen, page, priority)
    # Ranking needs no engine state, so it happens before the lock; pages past the history are dropped under it
    # (decode may still grow the history), which keeps the order: (priority desc, page desc), duplicates merged.
    ranks = [sorted({p: q for p, q in zip(rq.pages, rq.priority) if p >= 0}.items(), key=lambda x: (-x[1], -x[0]))
             for rq in requests]
    with eng.lock, eng.on_main_stream():
        try:
            for rq, ranked in zip(requests, ranks):
                st = eng.rows[rq.row] if 0 <= rq.row < len(eng.rows) else None
                if st is None or st.gen != rq.gen:
                    continue  # finished or replaced before its cycle was planned
                if count_cycle:   # an admission warm start (`residency.level1.warm_start`) is not a cycle
                    eng.stats.add(st.rid, "cycles")
                cap = min(eng.cfg.max_resident_pages, rq.budget or eng.cfg.max_resident_pages)
                n_pages = len(st.mpages)
                ranked = [x for x in ranked if x[0] < n_pages]
                if len(ranked) > cap:
                    eng.stats.add(st.rid, "budget_hits", len(ranked) - cap)
                    eng.stats.add(st.rid, "tail_drops", sum(q == float("inf") for _, q in ranked[cap:]))
                    ranked = ranked[:cap]
                sel = {p for p, _ in ranked}
                st.selection = frozenset(sel)
                for p in sel & st.recall.keys():
                    eng.lru.touch(st.recall[p])
                missing = [(p, q) for p, q in ranked if p not in st.recall and p not in st.ring]
                # dict order = oldest recalled first. The page holding the newest chunk stays: decode writes its
                # next chunk there during the very forward a recall copy into a reused block could overlap.
                tip = (st.n_chunks - 1) // pc
                stale = [p for p in st.recall if p not in sel and p != tip]
                while stale and len(st.recall) + len(missing) > cap:
                    blk = st.recall[stale.pop(0)]
                    _evict(eng, blk, touched, cleared)
                    eng.blocks.push(blk)
                over = len(st.recall) + len(missing) - cap
                if over > 0:  # only the kept newest page is left to evict: the lowest-priority new pages give way
                    eng.stats.add(st.rid, "budget_hits", over)
                    eng.stats.add(st.rid, "tail_drops", sum(q == float("inf") for _, q in missing[-over:]))
                    missing = missing[:-over]
                need += [(rq.row, rq.gen, p, q) for p, q in missing]

            def evictable(blk: int) -> bool:
                row, gen, page = eng.owner[blk]
                st = eng.rows[row]
                return st is not None and st.gen == gen and page not in st.selection and page != (st.n_chunks - 1) // pc

            # Within this pass evictability is fixed (selections are set above, nothing else runs under the lock) and
            # the LRU only loses the victims taken, so one forward scan yields the same victims as a fresh search each.
            victims = eng.lru.victims(evictable)
            for row, gen, page, prio in need:
                st = eng.rows[row]
                blk = eng.blocks.pop()
                if blk is None:
                    blk = next(victims, None)
                    if blk is not None:
                        _evict(eng, blk, touched, cleared)
                if blk is None:  # reserve exhausted: degrade, lowest priority last in `need` order per request
                    eng.stats.add(st.rid, "budget_hits")
                    if prio == float("inf"):
                        eng.stats.add(st.rid, "tail_drops")
                    continue
                eng.owner[blk] = (row, gen, page)
                eng.inflight.add(blk)
                plan.entries.append((row, gen, page, st.mpages[page], blk))
        finally:  # victims leave the table before their blocks are overwritten, and before any error propagates
            eng.lut.clear_pages(cleared)
        eng.rebuild_resident_tables(touched)
    return plan


def _keep(cache: dict[str, torch.Tensor], key: str, stage: torch.Tensor) -> None:
    if key not in cache or stage.numel() > cache[key].numel():
        cache[key] = stage.view(-1)


def execute_recall(eng: "OffloadEngine", plan: RecallPlan) -> None:
    """Copy the planned pages mirror -> reserve, without the engine lock: in-flight blocks are neither read nor
    written by anyone else. If the request finishes meanwhile its mirror pages may be reused and the copy
    reads mixed bytes; publish then sees the changed generation and discards them."""
    if not plan.entries:
        return
    src = torch.tensor([e[3] for e in plan.entries], dtype=torch.int64)
    dst = torch.tensor([e[4] for e in plan.entries], dtype=torch.int64)
    side = eng.side_stream
    if side is not None:
        side.wait_stream(eng.main_stream)  # forwards that read the victims' old entries finish first
    with eng.copy_lock, (torch.cuda.stream(side) if side is not None else nullcontext()):
        stage = gather_copy(eng.mirror.kv, eng.reserve.kv, src, dst, eng.staging.get("kv"))
        _keep(eng.staging, "kv", stage)
        if eng.copy_hook is not None:
            eng.copy_hook()
        if eng.reserve.index.shape[0]:
            stage = gather_copy(eng.mirror.index, eng.reserve.index, src, dst, eng.staging.get("index"))
            _keep(eng.staging, "index", stage)
        if side is not None:
            side.synchronize()  # the worker waits, not decode: bytes land before publish and before stage reuse
    plan.nbytes = len(plan.entries) * (eng.reserve.kv.shape[0] * eng.reserve.kv.shape[2]
                                       + eng.reserve.index.shape[0] * eng.reserve.index.shape[2])


def publish_recall(eng: "OffloadEngine", plan: RecallPlan, also_count: str | None = None) -> int:
    """Write the lookup table for the copied pages; returns the number of pages published. also_count: a second
    counter the published pages are added to besides recall_pages (e.g. "warm_start_pages")."""
    pc = eng.layout.page_chunks
    published: dict[int, int] = {}  # row -> pages published
    mps: list[int] = []
    counts: list[int] = []
    cells: list[int] = []
    done = 0
    with eng.lock, eng.on_main_stream():
        for row, gen, page, mp, blk in plan.entries:
            eng.inflight.discard(blk)
            st = eng.rows[row]
            if st is None or st.gen != gen or page in st.recall or page in st.ring:
                eng.owner[blk] = None
                eng.blocks.push(blk)
                if st is not None and st.gen == gen:
                    eng.stats.add(st.rid, "cancelled_pages")
                else:
                    eng.stats.finished["cancelled_pages"] += 1
                continue
            st.recall[page] = blk
            eng.lru.touch(blk)
            mps.append(mp)  # distinct: a second plan entry for the same page is discarded above
            counts.append(min(pc, st.n_chunks - page * pc))
            cells.append(blk * pc)
            published[row] = published.get(row, 0) + 1
            done += 1
        eng.lut.set_pages(mps, counts, cells)
        per_page = plan.nbytes // max(1, len(plan.entries))
        for row, n in published.items():
            eng.stats.add(eng.rows[row].rid, "recall_pages", n)
            eng.stats.add(eng.rows[row].rid, "recall_bytes", n * per_page)
            if also_count:
                eng.stats.add(eng.rows[row].rid, also_count, n)
        eng.rebuild_resident_tables(published)
        eng.stats.cycle(done, plan.nbytes, time.perf_counter() - plan.t0)
    plan.staging.clear()
    return done


def cancel_recall(eng: "OffloadEngine", plan: RecallPlan) -> None:
    """Give back a plan's in-flight blocks without publishing anything (the copy failed)."""
    with eng.lock:
        for row, gen, page, mp, blk in plan.entries:
            eng.inflight.discard(blk)
            eng.owner[blk] = None
            eng.blocks.push(blk)
        eng.stats.finished["cancelled_pages"] += len(plan.entries)
    plan.entries.clear()
    plan.staging.clear()


def recall_now(eng: "OffloadEngine", requests: Sequence[RecallRequest]) -> RecallPlan:
    """Plan, copy and publish in one call (synchronous; tests, benches and warm starts)."""
    plan = plan_recall(eng, requests)
    execute_recall(eng, plan)
    publish_recall(eng, plan)
    return plan
