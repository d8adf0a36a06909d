"""A hypothesis state machine over the three tiers with the host mirror as a landing window: a
`TieredEngine` whose mirror holds max_rows x 3 page slots for 4 x 32 page ids, under admissions, decode steps,
Level-1 recalls, finishes, cache pressure (a cold cache), disk full (write-behind fails, pages stay pinned in
DRAM) and slow disk reads, with the read-ahead threads running.

Invariants after every step: every live page's host bytes (the window's slot, or the tier's copy once released)
equal the original chunk rows; every chunk the lookup table maps reads the original bytes from the reserve; the
engine's own invariants (`check_invariants`) and the cache's (`check`) hold; after a step's seal a row holds at
most two slots. At finish a request's slots, page ids and disk slots all come back.
"""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flashmemory.offload import (
    Admission,
    AppendRound,
    BatchSync,
    EngineConfig,
    OffloadLayout,
    RecallRequest,
    RowSync,
    check_invariants,
)
from flashmemory.offload.disk import FaultyFileOps, HostPageCache, PageStore, disk_page_bytes
from flashmemory.offload.disk.format import unpack_rows
from flashmemory.offload.mirror import RELEASED
from flashmemory.offload.tiered_mirror import TieredEngine

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
CFG = EngineConfig(max_rows=4, max_chunks=128, recall_blocks=10, decode_pages=2, max_resident_pages=4, mirror_slots=12)
PC = LAYOUT.page_chunks


class WindowTiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self.dir = tempfile.mkdtemp(prefix="fm-window-sm-")
        self.ops = FaultyFileOps()
        pb = disk_page_bytes(LAYOUT)
        store = PageStore(self.dir, 160 * (pb + 8192), pb, ops=self.ops)
        self.eng = TieredEngine(LAYOUT, CFG, HostPageCache(store, 3 * pb, readers=2))
        self.g = torch.Generator().manual_seed(0)
        self.kv: dict[int, torch.Tensor] = {}  # row -> original kv chunk rows [L, n, 8] of its request
        self.ix: dict[int, torch.Tensor] = {}
        self.next_rid = 0

    def teardown(self) -> None:
        self.eng.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _chunks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = torch.randint(0, 256, (LAYOUT.n_layers, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=self.g)
        ix = torch.randint(0, 256, (LAYOUT.n_layers, n, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=self.g)
        return kv, ix

    # -- rules -------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.kv) < CFG.max_rows)
    @rule(n=st.integers(1, 24), warm=st.integers(0, 3))
    def admit(self, n: int, warm: int) -> None:
        row = min(set(range(CFG.max_rows)) - set(self.kv))
        kv, ix = self._chunks(n)
        self.eng.sync_batch(
            BatchSync(rows=(RowSync(row, Admission(row, f"req{self.next_rid}", n, kv, ix, warm_pages=warm)),))
        )
        self.next_rid += 1
        self.kv[row], self.ix[row] = kv, ix

    @precondition(lambda self: self.kv)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        live = sorted(r for r in self.kv if self.kv[r].shape[1] < CFG.max_chunks)
        if not live:
            return
        rows = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        kv, ix = self._chunks(len(rows))
        self.eng.sync_batch(BatchSync(appends=(AppendRound(tuple(rows), kv, ix),)))
        for i, r in enumerate(rows):
            self.kv[r] = torch.cat([self.kv[r], kv[:, i : i + 1]], 1)
            self.ix[r] = torch.cat([self.ix[r], ix[:, i : i + 1]], 1)

    @precondition(lambda self: self.kv)
    @rule(data=st.data())
    def recall(self, data: st.DataObject) -> None:
        snap = self.eng.snapshot_rows()
        reqs = []
        for r in data.draw(st.lists(st.sampled_from(sorted(self.kv)), min_size=1, unique=True)):
            pages = data.draw(st.lists(st.integers(0, LAYOUT.pages_for(snap[r][1]) - 1), max_size=5))
            reqs.append(RecallRequest(r, snap[r][0], tuple(pages), tuple(float(p) for p in pages)))
        self.eng.recaller.recall(reqs)

    @precondition(lambda self: self.kv)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.kv)))
        self.eng.seal()  # what the finishing step's seal would release of the other rows, released first
        m, stt = self.eng.mirror, self.eng.rows[row]
        held = sum(int(m.slot_of[mp]) >= 0 for mp in stt.mpages)
        before, free_ids, rid = m.slots_in_use, m.free_pages, str(stt.rid)
        self.eng.sync_batch(BatchSync(finished=(row,)))
        assert m.slots_in_use == before - held, "a finished request's slots did not come back"
        assert m.free_pages == free_ids + len(stt.mpages) and all(int(m.slot_of[mp]) < 0 for mp in stt.mpages)
        assert self.eng.tier.store.pages_of(rid) == set() and rid not in self.eng.tier.live_pages()
        del self.kv[row], self.ix[row]

    @rule()
    def cold_cache(self) -> None:
        self.eng.tier.drop_clean()

    @rule(on=st.booleans())
    def disk_full(self, on: bool) -> None:
        self.ops.plan.full = on
        if not on:
            self.eng.tier.retry_pinned()

    @rule(delay=st.sampled_from([0.0, 0.001]))
    def slow_disk(self, delay: float) -> None:
        self.ops.plan.delay_s = delay

    # -- invariants ----------------------------------------------------------------------------------
    @invariant()
    def every_page_equals_the_original(self) -> None:
        eng, m = self.eng, self.eng.mirror
        for row, kv in self.kv.items():
            stt = eng.rows[row]
            n = kv.shape[1]
            assert stt.n_chunks == n
            j = torch.arange(n)
            for p, mp in enumerate(stt.mpages):  # the host copy: the window's slot, else the tier's bytes
                s = int(m.slot_of[mp])
                if s == RELEASED:
                    hk, hi = unpack_rows(eng.held_page(row, p), LAYOUT)
                else:
                    hk, hi = m.kv[:, m.row(mp)], m.index[:, m.row(mp)]
                sel = j[(j // PC) == p]
                got = LAYOUT.kv.read_chunks(hk.unsqueeze(1).contiguous(), torch.zeros_like(sel), sel % PC)
                assert torch.equal(got, kv[:, sel]), f"row {row} page {p}: host bytes differ from the original"
                goti = LAYOUT.index.read_chunks(hi.unsqueeze(1).contiguous(), torch.zeros_like(sel), sel % PC)
                assert torch.equal(goti, self.ix[row][:, sel][list(LAYOUT.offload_index_layers)])
            cells = eng.cells(torch.tensor([row]), j.unsqueeze(0))[0].long()
            ok = cells >= 0
            if bool(ok.any()):  # what attention reads: every mapped chunk is the original
                c = cells[ok]
                got = LAYOUT.kv.read_chunks(eng.reserve.kv, c // PC, c % PC)
                assert torch.equal(got, kv[:, ok]), f"row {row}: a resident chunk differs from the original"
        assert not check_invariants(eng)
        eng.tier.check()
        assert m.slots_in_use <= 2 * len(self.kv) and m.peak_slots <= m.n_slots


WindowTiers.TestCase.settings = settings(
    max_examples=20, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestWindowTiers = WindowTiers.TestCase
