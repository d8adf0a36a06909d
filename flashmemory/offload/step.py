"""`StepSync`: one decode step's request lifecycle in one call (`sync_batch`), mixed into `OffloadEngine`.

The step is described as plain data (`offload.sync.BatchSync`) and applied in the order of the separate
lifecycle verbs (engine.py), with the admissions' warm starts: from the admission's own device rows
(`landing.DeviceLanding.warm_from_rows`) or from the host mirror, held to `EngineConfig.warm_step_pages`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from flashmemory.offload.sync import BatchSync, SyncResult

if TYPE_CHECKING:
    from flashmemory.offload.layout import OffloadLayout
    from flashmemory.offload.recall import Recaller
    from flashmemory.offload.rows import RowState


class StepSync:
    """Mixed into `OffloadEngine`; every verb called below is the engine's."""

    layout: OffloadLayout
    cfg: Any
    recaller: Recaller
    lock: Any
    rows: list[RowState | None]

    _live: Callable[[int], RowState]  # engine.py

    def sync_batch(self, sync: BatchSync) -> SyncResult:
        """One decode step's lifecycle in one call, in this order: admissions and settles of earlier steps whose
        rows reached the host mirror are written there (`apply_lands`); the caller's stores (`sync.stores`:
        `store_chunks`, one hold of the lock, or `stage_chunks` when they name their rows), `after_stores`; finish
        `sync.finished`; per batch row, admit (newest page made resident, then the warm start) and claim added
        mirror pages; then each append round. Each part takes the lock itself as the separate calls do (the
        warm-start copy runs without it); the result is read in one last hold: mirror pages and history of the
        synced rows, resident pages of `sync.batch`.

        The host never waits for the device here, and a new request never decodes with part of its warm set: from
        its first decode step on it attends its whole warm set (its newest `warm_pages` pages, the newest one in a
        decode block), nothing missing. The pages are in the tables when this returns, and the forward stream
        orders their bytes before the forward that reads them: the forward waits on the device, the host does not.
        - An admission whose rows live where the reserve does (copy mode: read from sglang's device pool) warms
          from those rows, device to device (`warm_from_rows`): no host link crossed.
        - An admission from the host mirror (shrink mode: PD landed it there) copies its warm set host -> device
          (`Recaller.warm_start(wait=False)`). The host link's share per step is `cfg.warm_step_pages`: a caller
          that can hold requests back (a waiting queue) admits, per step, the leading requests whose warm pages
          fit it (`admit_within` over `warm_pages_of`; always at least one), and the others one step later. An
          admission handed in here is copied whole whatever the budget: it decodes in this step."""
        self.apply_lands()
        if sync.stores is not None:
            s = sync.stores
            if s.rows is not None and s.kv is not None:  # device rows of every layer: staged, no host wait
                self.stage_chunks(s.rows, s.m, s.kv, s.index or (None,) * len(s.layers))
            else:
                self.store_chunks(s.m, s.layers, s.kv, s.index)
        self.after_stores(sync)
        for row in sync.finished:
            self.finish(row)
        for rs in sync.rows:
            a = rs.admit
            if a is not None:
                self.admit(a.row, a.kv, a.index, rid=a.rid, mpages=a.mpages, n_chunks=a.n_chunks)
                if a.kv is not None and self.near(a.kv):
                    self.warm_from_rows(a.row, a.warm_pages, a.kv, a.index)
                else:
                    self.open_tail_page(a.row)  # the newest page is readable from the first step on
                    if a.warm_pages > 1:  # older pages (warm_pages counts the newest), without a host wait
                        self.recaller.warm_start(a.row, a.warm_pages, wait=False)
            if rs.add_pages:
                self.add_pages(rs.row, rs.add_pages)
        cells = tuple(self.decode_append(list(r.rows), r.kv, r.index) for r in sync.appends)
        with self.lock:
            sts = {rs.row: self._live(rs.row) for rs in sync.rows}
            res = None if sync.batch is None else self.resident_pages(torch.tensor(sync.batch, dtype=torch.int64))
            rows = [None if r < 0 else self.rows[r] for r in sync.batch or ()]
            unplanned = tuple(st is not None and not st.planned for st in rows)
            return SyncResult(
                cells,
                {r: tuple(st.mpages) for r, st in sts.items()},
                {r: st.n_chunks for r, st in sts.items()},
                res,
                unplanned,
            )

    def warm_pages_of(self, n_chunks: int, warm_pages: int) -> int:
        """Host -> device pages the warm start of an admission of n_chunks asking for warm_pages copies (its
        newest page excluded: a decode block, opened apart): what it takes of `cfg.warm_step_pages`."""
        return max(0, min(warm_pages, self.layout.pages_for(n_chunks)) - 1)

    def after_stores(self, sync: BatchSync) -> None:
        """Inside `sync_batch`, once the step's stores are in the mirror and before any row changes: nothing here
        (the disk tier seals complete pages at this point)."""


def admit_within(costs: Sequence[int], budget: int) -> int:
    """How many of the waiting requests, in order, to admit this step: the longest prefix whose warm-start costs
    (host -> device pages, `StepSync.warm_pages_of`) sum to at most `budget`, and at least one (a request whose
    own warm set is over the budget still runs, alone). 0 only when nothing waits."""
    total = 0
    for i, c in enumerate(costs):
        total += c
        if total > budget and i > 0:
            return i
    return len(costs)


@dataclass
class StepBudget:
    """The warm-start pages let out of the queue during one decode step: `passed` rid -> warm pages of the
    requests let through since decode step `step` began (one still in the queue was not taken and is decided
    again)."""

    step: int = -1
    passed: dict[str, int] = field(default_factory=dict)

    def hold(self, step: int, budget: int, queue: Sequence[tuple[str, int]], n_next: int) -> set[str]:
        """queue: (rid, warm pages) in order, of which sglang takes the first `n_next`. Returns the rids to hold
        back: the tail after the leading requests whose warm pages, with those let through earlier in this step,
        fit `budget` (the first of the step runs even over it); nothing when all `n_next` fit."""
        if step != self.step:
            self.step, self.passed = step, {}
        waiting = {rid for rid, _ in queue}
        spent = sum(c for rid, c in self.passed.items() if rid not in waiting)
        self.passed = {rid: c for rid, c in self.passed.items() if rid not in waiting}
        head = [c for _, c in queue[: max(n_next, 0)]]
        k = admit_within([spent, *head], budget) - 1 if self.passed else admit_within(head, budget)
        self.passed.update(queue[:k])
        return {rid for rid, _ in queue[k:]} if k < len(head) else set()
