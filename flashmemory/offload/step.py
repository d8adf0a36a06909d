"""`StepSync`: one decode step's request lifecycle in one call (`sync_batch`), mixed into `OffloadEngine`.

The step is described as plain data (`offload.sync.BatchSync`) and applied in the order of the separate
lifecycle verbs (engine.py), with the admissions' warm starts: from the admission's own device rows
(`landing.DeviceLanding.warm_from_rows`) or from the host mirror, held to `EngineConfig.warm_step_pages`.
"""

from __future__ import annotations

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

    def _live(self, row: int) -> RowState:  # engine.py
        raise NotImplementedError

    def sync_batch(self, sync: BatchSync) -> SyncResult:
        """One decode step's lifecycle in one call, in this order: admissions of earlier steps whose rows reached
        the host mirror are written there (`apply_lands`); the caller's stores (`sync.stores`, one hold of the
        lock), `after_stores`; finish `sync.finished`; per batch row, admit (newest page made resident, then the
        warm start) and claim added mirror pages; then each append round. Each part takes the lock itself as the
        separate calls do (the warm-start copy runs without it); the result is read in one last hold: mirror
        pages and history of the synced rows, resident pages of `sync.batch`.

        The host never waits for the device here. What a new request attends from its first decode step on: its
        whole warm set (its newest `warm_pages` pages, the newest one in a decode block), nothing missing, as
        long as the step's warm budget holds it; its pages are in the tables when this returns, and the forward
        stream orders their bytes before the forward that reads them.
        - An admission whose rows live where the reserve does (copy mode: read from sglang's device pool) warms
          from those rows, device to device (`warm_from_rows`): no host link crossed, no budget, always whole.
        - An admission from the host mirror (shrink mode: PD landed it there) copies host -> device, at most
          `cfg.warm_step_pages` pages per call across such admissions, newest pages first, in batch order. The
          caller keeps a burst within it by holding requests back until the next step (`warm_pages_of` gives
          each one's cost); an admission past it would start with its newest page and whatever the budget left
          (the rest with its first Level-1 cycle)."""
        self.apply_lands()
        if sync.stores is not None:
            s = sync.stores
            self.store_chunks(s.m, s.layers, s.kv, s.index)
        self.after_stores(sync)
        for row in sync.finished:
            self.finish(row)
        budget = self.cfg.warm_step_pages
        for rs in sync.rows:
            a = rs.admit
            if a is not None:
                self.admit(a.row, a.kv, a.index, rid=a.rid, mpages=a.mpages, n_chunks=a.n_chunks)
                if a.kv is not None and self.near(a.kv):
                    self.warm_from_rows(a.row, a.warm_pages, a.kv, a.index)
                else:
                    self.open_tail_page(a.row)  # the newest page is readable from the first step on
                    n = min(a.warm_pages, budget + 1)  # warm_pages counts the newest page, held already
                    if n > 1:  # older pages, copied without a host wait
                        budget -= self.recaller.warm_start(a.row, n, wait=False)
            if rs.add_pages:
                self.add_pages(rs.row, rs.add_pages)
        cells = tuple(self.decode_append(list(r.rows), r.kv, r.index) for r in sync.appends)
        with self.lock:
            sts = {rs.row: self._live(rs.row) for rs in sync.rows}
            res = None if sync.batch is None else self.resident_pages(torch.tensor(sync.batch, dtype=torch.int64))
            return SyncResult(
                cells, {r: tuple(st.mpages) for r, st in sts.items()}, {r: st.n_chunks for r, st in sts.items()}, res
            )

    def warm_pages_of(self, n_chunks: int, warm_pages: int) -> int:
        """Host -> device pages the warm start of an admission of n_chunks asking for warm_pages copies (its
        newest page excluded: a decode block, opened apart): what it takes of `cfg.warm_step_pages`."""
        return max(0, min(warm_pages, self.layout.pages_for(n_chunks)) - 1)

    def after_stores(self, sync: BatchSync) -> None:
        """Inside `sync_batch`, once the step's stores are in the mirror and before any row changes: nothing here
        (the disk tier seals complete pages at this point)."""
