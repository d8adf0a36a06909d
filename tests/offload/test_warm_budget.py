"""An admission's warm start from host memory (`EngineConfig.warm_step_pages`, default 16 pages a step): the budget
is spent by the caller that holds requests back (`admit_within` over `warm_pages_of`), so a burst of arrivals
enters over several steps, and every admission handed to `sync_batch` is copied whole: its first decode step
attends its whole warm set. Device rows warm from themselves: tests/offload/test_landing.py."""

from __future__ import annotations

import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, check_invariants
from flashmemory.offload.step import admit_within
from flashmemory.offload.sync import Admission, BatchSync, RowSync
from tests.support.cuda_standin import count_blocking, on_thread, reset

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))


def admission(row: int, n: int, warm: int) -> RowSync:
    g = torch.Generator().manual_seed(row)
    kv = torch.randint(0, 256, (3, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = torch.randint(0, 256, (3, n, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g)
    return RowSync(row, Admission(row, f"r{row}", n, kv=kv, index=ix, warm_pages=warm))


def test_admit_within_takes_the_leading_requests_the_budget_holds():
    assert admit_within([3, 3, 3, 3, 3, 3], 16) == 5  # 15 pages; the sixth waits a step
    assert admit_within([3] * 6, 18) == 6
    assert admit_within([40, 1], 16) == 1  # one over the budget runs alone
    assert admit_within([0, 0, 20], 16) == 2 and admit_within([], 16) == 0


def test_a_burst_of_host_admissions_is_held_to_the_budget_and_each_is_whole(monkeypatch):
    count_blocking(monkeypatch)  # the reserve on the (stand-in) device, the admissions' rows in host memory
    cfg = EngineConfig(max_rows=6, max_chunks=64, recall_blocks=32, decode_pages=2, max_resident_pages=4)
    eng = OffloadEngine(LAYOUT, cfg)
    # Six requests of 6 pages (24 chunks) wait, each asking for its newest 4 pages (3 to copy): 18 > 16.
    costs = [eng.warm_pages_of(24, 4)] * 6
    assert cfg.warm_step_pages == 16 and costs == [3] * 6 and eng.warm_pages_of(3, 4) == 0
    first = admit_within(costs, cfg.warm_step_pages)
    assert first == 5
    reset()
    res = eng.sync_batch(BatchSync(rows=tuple(admission(r, 24, 4) for r in range(first)), batch=tuple(range(first))))
    assert not [b for b in on_thread() if b.kind in ("d2h", "sync")]  # no host wait (rows are host memory here)
    resident = [sorted(p for p in row.tolist() if p >= 0) for row in res.resident]
    assert resident == [[2, 3, 4, 5]] * first  # whole warm sets at the first step
    res = eng.sync_batch(BatchSync(rows=(admission(5, 24, 4),), batch=tuple(range(6))))  # the held one, next step
    assert [sorted(p for p in row.tolist() if p >= 0) for row in res.resident] == [[2, 3, 4, 5]] * 6
    assert eng.metrics()["total"]["warm_start_pages"] == 18
    assert not check_invariants(eng)
