"""Admissions whose rows are on the core's device (`flashmemory.offload.landing`), with the blocking-op stand-in:
a burst of arrivals warms every request's whole warm set from its own rows in one step with no host wait (past
the host -> device step budget, which such admissions do not use); their host-mirror copy lands a step later;
a recall that reads a row's mirror pages before that waits for the land on its own thread; a land of a request
that finished is dropped."""

from __future__ import annotations

import threading

import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, RecallRequest, check_invariants
from flashmemory.offload.sync import Admission, BatchSync, RowSync
from tests.support.cuda_standin import count_blocking, on_device, on_thread, reset

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
CFG = EngineConfig(max_rows=6, max_chunks=64, recall_blocks=32, decode_pages=2, max_resident_pages=4)


def _rows(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 256, (3, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = torch.randint(0, 256, (3, n, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g)
    return kv, ix


def _admission(row: int, n: int, warm: int, seed: int | None = None) -> RowSync:
    kv, ix = _rows(row if seed is None else seed, n)
    return RowSync(row, Admission(row, f"r{row}", n, kv=on_device(kv), index=on_device(ix), warm_pages=warm))


def _step(eng: OffloadEngine, sync: BatchSync):
    eng.begin_forward()
    try:
        return eng.sync_batch(sync)
    finally:
        eng.end_forward()


def _resident(res) -> list[list[int]]:
    return [sorted(p for p in row.tolist() if p >= 0) for row in res.resident]


def test_a_burst_of_device_admissions_warms_every_whole_set_without_a_host_wait(monkeypatch):
    count_blocking(monkeypatch)
    eng = OffloadEngine(LAYOUT, CFG)
    assert eng.cfg.warm_step_pages == 16  # the default bound (host -> device pages per step)
    # Six requests of 6 pages arrive in one step, each asking for its newest 4 pages: 18 older pages to copy, past
    # the bound, all from the requests' own device rows.
    burst = BatchSync(rows=tuple(_admission(r, 24, 4) for r in range(6)), batch=tuple(range(6)))
    reset()
    res = _step(eng, burst)
    waits = on_thread()
    assert not waits, [f"{b.kind} {b.where}" for b in waits]
    assert _resident(res) == [[2, 3, 4, 5]] * 6  # every request's first decode step sees its whole warm set
    assert eng.landing_rows() == set(range(6))  # the mirror copies are on their way, not waited for
    # The next step writes them into the mirror (their copies are complete), still without a host wait.
    reset()
    _step(eng, BatchSync(batch=tuple(range(6))))
    assert not on_thread() and not eng.landing_rows()
    assert eng.metrics()["total"]["warm_start_pages"] == 18
    assert not check_invariants(eng)  # reserve bytes == mirror bytes == the admission's rows
    kv, _ = _rows(5, 24)
    got = LAYOUT.kv.read_chunks(
        eng.storage().mirror_kv, torch.tensor(eng.rows[5].mpages).repeat_interleave(4), torch.arange(4).repeat(6)
    )
    assert torch.equal(got, kv)


def test_a_recall_before_the_land_waits_for_it_on_its_own_thread(monkeypatch):
    si = count_blocking(monkeypatch)
    eng = OffloadEngine(LAYOUT, CFG)
    _step(eng, BatchSync(rows=(_admission(0, 24, 2),), batch=(0,)))  # pages 4, 5 resident; 0..3 mirror only
    assert eng.landing_rows() == {0}
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            eng.recaller.recall([RecallRequest(0, eng.gen(0), (0, 1), (2.0, 1.0))])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=worker, name="flashmemory-level1")
    t.start()
    t.join(30)
    assert not errors, errors
    assert not eng.landing_rows()  # the worker applied the land before it read the mirror
    assert any(name == "flashmemory-level1" and what == "event" for name, what in si.host_syncs)
    assert not [w for w in si.host_syncs if w[0] == "MainThread"]
    assert sorted(p for p in eng.resident_pages(torch.tensor([0]))[0].tolist() if p >= 0) == [0, 1, 4, 5]
    assert not check_invariants(eng)  # the recalled pages hold the admission's bytes, not an empty mirror


def test_the_land_of_a_finished_request_is_dropped(monkeypatch):
    count_blocking(monkeypatch)
    eng = OffloadEngine(LAYOUT, EngineConfig(max_rows=2, max_chunks=64, recall_blocks=8, decode_pages=2,
                                             max_resident_pages=4, mirror_pages=6))  # fmt: skip
    _step(eng, BatchSync(rows=(_admission(0, 24, 2),), batch=(0,)))
    event = type(eng.lands[0].done)
    monkeypatch.setattr(event, "query", lambda self: False)  # its copy is still running at the next step
    # It leaves before its land is applied; a new request takes its row and its mirror pages in the same step.
    res = _step(eng, BatchSync(finished=(0,), rows=(_admission(0, 24, 2, seed=7),), batch=(0,)))
    assert [p.gen for p in eng.lands] == [eng.gen(0)]  # only the new request's
    monkeypatch.setattr(event, "query", lambda self: True)
    eng.flush_lands()
    got = LAYOUT.kv.read_chunks(
        eng.storage().mirror_kv, torch.tensor(res.mpages[0]).repeat_interleave(4), torch.arange(4).repeat(6)
    )
    assert torch.equal(got, _rows(7, 24)[0])  # the first request's late land did not overwrite it
    assert not check_invariants(eng)
