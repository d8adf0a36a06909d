"""`TierCopy`: how the disk tier copies a recall plan into the reserve (`Recaller.source`), mixed into
`tiered_mirror.TieredEngine` (read that module's doc: "recall"). Sealed pages come through the host page cache
(read-ahead first), unsealed ones from the mirror; then one indexed copy per layer group into the reserve.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from flashmemory.offload.disk import CorruptPageError
from flashmemory.offload.gather import gather_copy
from flashmemory.offload.recall import RecallPlan, RecallRequest

if TYPE_CHECKING:
    from flashmemory.offload.disk import HostPageCache


class TierCopy:
    """Mixed into `TieredEngine`; the attributes are the engine's."""

    tier: HostPageCache
    sealed: dict[int, tuple[int, int]]
    recalls_waited: int
    readahead_pages: int
    lock: Any

    # ---- recall copy (`Recaller.source`) -----------------------------------------------------------------
    def prefetch_requests(self, requests: Sequence[RecallRequest]) -> int:
        """Read-ahead as soon as a cycle's selection is known (Level 1's worker, before the plan): every selected
        page that is sealed, not resident in the reserve and not in the host cache is queued on the cache's
        readers, so the copy (on the worker, or on the decode thread in lockstep) finds it in DRAM. Returns the
        reads queued. Only reads the row states (under the lock); the reads run on the reader threads."""
        wanted: dict[str, list[int]] = {}
        with self.lock:
            for rq in requests:
                st = self.rows[rq.row] if 0 <= rq.row < len(self.rows) else None
                sg = self.sealed.get(rq.row)
                if st is None or st.gen != rq.gen or sg is None or sg[0] != rq.gen:
                    continue
                cold = [p for p in rq.pages if 0 <= p < sg[1] and p not in st.recall]
                if cold:
                    wanted[str(st.rid)] = cold
        n = sum(self.tier.prefetch(rid, pages) for rid, pages in wanted.items())
        self.readahead_pages += n
        return n

    def _tier_keys(self, plan: RecallPlan) -> tuple[list[str | None], list[bool]]:
        """Per plan entry: the rid whose tier holds that page (sealed) or None (read it from the mirror), and whether
        its request is still the one planned (a stale entry's bytes are discarded at publish). Caller holds the lock."""
        out: list[str | None] = []
        live: list[bool] = []
        for row, gen, page, _mp, _blk in plan.entries:
            st, sg = self.rows[row], self.sealed.get(row)
            live.append(st is not None and st.gen == gen)
            sealed = live[-1] and sg is not None and sg[0] == gen and page < sg[1]
            out.append(str(st.rid) if sealed else None)
        return out, live

    def copy_plan(self, plan: RecallPlan, wait: bool = True) -> None:
        """Copy the plan's pages into the reserve, sealed ones through the tier (see the module doc). The unsealed
        pages' mirror bytes are staged in the same lock hold that decides which pages are sealed (a seal releases
        a page's window slot); the tier reads run without the engine lock (the planned blocks are in flight: no
        one else reads or writes them). wait=False (the decode thread): the host does not wait for the device
        copy (`_to_reserve`); a read of a page not in host memory still waits for the disk (counted)."""
        rec, lay = self.recaller, self.layout
        self.ensure_landed({e[0] for e in plan.entries}, {e[3] for e in plan.entries})  # unsealed: mirror reads
        k, n_ix = len(plan.entries), self.mirror.index.shape[0]
        kv = torch.zeros((lay.n_layers, k, lay.kv_page_bytes), dtype=torch.uint8)
        ix = torch.zeros((n_ix, k, lay.index_page_bytes), dtype=torch.uint8)
        with self.lock:
            keys, live = self._tier_keys(plan)
            js = [j for j, (rid, ok) in enumerate(zip(keys, live)) if rid is None and ok]
            if js:
                rows = self.mirror.rows(torch.tensor([plan.entries[j][3] for j in js], dtype=torch.int64))
                kv[:, js] = self.mirror.kv[:, rows]
                if n_ix:
                    ix[:, js] = self.mirror.index[:, rows]
        wanted: dict[str, list[int]] = {}
        for (_r, _g, page, _m, _b), rid in zip(plan.entries, keys):
            if rid is not None:
                wanted.setdefault(rid, []).append(page)
        for rid, pages in wanted.items():  # read-ahead: the readers fetch while earlier pages are copied
            self.tier.prefetch(rid, pages)
        nkv = lay.n_layers * lay.kv_page_bytes
        bad: dict[int, BaseException] = {}  # row -> its first read failure
        waited = False
        for j, ((row, _g, page, _mp, _b), rid) in enumerate(zip(plan.entries, keys)):
            if row in bad or rid is None:
                continue
            waited |= not self.tier.resident(rid, page)
            try:
                data = self.tier.get(rid, page)
            except KeyError:
                continue  # freed meanwhile (finished): publish discards this entry
            except CorruptPageError as e:
                bad[row] = e
                continue
            except Exception as e:  # noqa: BLE001 - an unreadable page fails its request, like a corrupt one
                err = CorruptPageError(rid, page, f"read failed: {type(e).__name__}: {e}")
                err.__cause__ = e
                bad[row] = err
                continue
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a copy: the view is read-only
            kv[:, j] = flat[:nkv].view(lay.n_layers, lay.kv_page_bytes)
            if n_ix:
                ix[:, j] = flat[nkv:].view(n_ix, lay.index_page_bytes)
        self.recalls_waited += waited
        if bad:
            keep = [j for j, e in enumerate(plan.entries) if e[0] not in bad]
            rec.cancel(RecallPlan(entries=[e for e in plan.entries if e[0] in bad]))
            plan.entries[:] = [plan.entries[j] for j in keep]
            kv, ix = kv[:, keep], ix[:, keep]
            plan.error = next(iter(bad.values()))
        self._to_reserve(plan, kv, ix, wait)

    def held_page(self, row: int, page: int) -> bytes:
        """The tier's bytes of logical page `page` of the request in `row` (`offload.check` reads released pages
        here): no counter, no LRU order changes. KeyError when the tier does not hold it."""
        with self.lock:
            rid = str(self._live(row).rid)
        return self.tier.peek(rid, page)

    def _to_reserve(self, plan: RecallPlan, kv: torch.Tensor, ix: torch.Tensor, wait: bool = True) -> None:
        """reserve[:, block_j] = staged page j, for kv [L, K, W] and Path-I ix [Li, K, Wi] (the mirror path's copy
        discipline: the side stream waits for the main one, the worker waits for the side one; wait=False: fresh
        pinned staging, no copy_lock and no host wait, `plan.ready` marks the copy for the publish's stream)."""
        if not plan.entries:
            return
        rec = self.recaller
        dst = torch.tensor([e[4] for e in plan.entries], dtype=torch.int64)
        side = rec.side_stream
        if not wait and side is not None:
            src = torch.arange(len(plan.entries))
            with self.order.copy_context():
                plan.staging.append(gather_copy(kv, self.reserve.kv, src, dst))
                if rec.copy_hook is not None:
                    rec.copy_hook()
                if self.reserve.index.shape[0]:
                    plan.staging.append(gather_copy(ix, self.reserve.index, src, dst))
                plan.ready = torch.cuda.Event()
                plan.ready.record(side)
            return
        if side is not None:
            side.wait_stream(rec.main_stream)
        with rec.copy_lock, torch.cuda.stream(side) if side is not None else nullcontext():
            src = torch.arange(len(plan.entries))
            gather_copy(kv, self.reserve.kv, src, dst)
            if rec.copy_hook is not None:
                rec.copy_hook()
            if self.reserve.index.shape[0]:
                gather_copy(ix, self.reserve.index, src, dst)
            if side is not None:
                side.synchronize()
