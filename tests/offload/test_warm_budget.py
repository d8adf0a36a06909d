"""An admission's warm start from host memory is bounded per decode step (`EngineConfig.warm_step_pages`): a burst
of such arrivals copies at most that many pages host -> device in one `sync_batch`, newest pages first and in
batch order; every admission holds its newest page from its first step, and the pages past the budget come with
its first Level-1 cycle (a caller keeps bursts within the budget, `warm_pages_of`, so that never happens). Device
rows warm from themselves, unbounded: tests/offload/test_landing.py."""

from __future__ import annotations

import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, check_invariants
from flashmemory.offload.sync import Admission, BatchSync, RowSync
from flashmemory.residency.level1 import AllPass, Level1, Level1Config
from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy
from tests.support.cuda_standin import count_blocking

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))


def admission(row: int, n: int, warm: int) -> RowSync:
    g = torch.Generator().manual_seed(row)
    kv = torch.randint(0, 256, (3, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = torch.randint(0, 256, (3, n, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g)
    return RowSync(row, Admission(row, f"r{row}", n, kv=kv, index=ix, warm_pages=warm))


def test_a_burst_of_host_admissions_copies_at_most_the_step_budget(monkeypatch):
    count_blocking(monkeypatch)  # the reserve on the (stand-in) device, the admissions' rows in host memory
    cfg = EngineConfig(max_rows=6, max_chunks=64, recall_blocks=32, decode_pages=2, max_resident_pages=4)
    eng = OffloadEngine(LAYOUT, cfg)
    # Six requests of 6 pages (24 chunks) arrive in one step, each asking for its newest 4 pages (3 to copy);
    # the default budget of 16 pages a step.
    assert cfg.warm_step_pages == 16 and eng.warm_pages_of(24, 4) == 3 and eng.warm_pages_of(3, 4) == 0
    res = eng.sync_batch(BatchSync(rows=tuple(admission(r, 24, 4) for r in range(6)), batch=tuple(range(6))))
    resident = [sorted(p for p in row.tolist() if p >= 0) for row in res.resident]
    # r0..r4: newest page + 3 older ones (15 pages); r5: its newest page + the one page the budget has left.
    assert resident == [[2, 3, 4, 5]] * 5 + [[4, 5]]
    assert eng.metrics()["total"]["warm_start_pages"] == 16
    check_invariants(eng)
    # Their first Level-1 cycle (due at once) brings the rest.
    sel = SelectionConfig(threshold=0.5, last_keep=16, first_keep=0, page_chunks=4, kmax=4)
    l1 = Level1(eng, AllPass(), ThresholdPagePolicy(sel), Level1Config(tau=4, max_resident_pages=4, async_recall=False))
    l1.on_step(list(range(6)), {}, torch.zeros(6, dtype=torch.int64))
    got = [sorted(p for p in row.tolist() if p >= 0) for row in eng.resident_pages(torch.arange(6))]
    assert got == [[2, 3, 4, 5]] * 6
    check_invariants(eng)
