"""Prefix sharing in copy mode: two requests hold the same pool pages (sglang's radix cache), each with its own
mirror pages and resident set. Every top-k pick resolves to the picking request's own reserve cell, and when one
request finishes the other's picks on the shared pages stay valid."""

from __future__ import annotations

import pytest
import torch

from flashmemory.offload import RecallRequest, recall_now
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.loc_map import LocMap
from tests.sglang.decode.test_copy_adapter import PAGE, env, fake_pool

pytestmark = pytest.mark.sglang
C4 = PAGE // 4  # c4 entries per pool page
SHARED = [5, 2]  # the prefix pages both requests hold, logical pages 0 and 1
PAGES = {"a": SHARED, "b": SHARED + [9]}
SEQ = {"a": 2 * PAGE, "b": 2 * PAGE + 120}  # tokens with the current one


def _step(adapter, rids: list[str]) -> torch.Tensor:
    width = max(len(PAGES[r]) for r in rids)
    table = torch.tensor([PAGES[r] + [-1] * (width - len(PAGES[r])) for r in rids], dtype=torch.int64)
    return adapter.begin_step(rids, table, torch.tensor([SEQ[r] for r in rids], dtype=torch.int64))


def _picks(rids: list[str]) -> torch.Tensor:
    """Every loc of the shared pages, for each batch row: [B, 2 * C4]."""
    locs = torch.tensor([p * C4 + j for p in SHARED for j in range(C4)], dtype=torch.int64)
    return locs.unsqueeze(0).expand(len(rids), -1).clone()


def _own_cells(adapter, row: int) -> torch.Tensor:
    """The core's cells of the row's own logical chunks 0 .. 2*C4-1 (the shared pages), int32 [2 * C4]."""
    return adapter.engine.cells(torch.tensor([row]), torch.arange(2 * C4).unsqueeze(0))[0].to(torch.int32)


def test_shared_prefix_pages_resolve_per_request_and_survive_a_finish():
    adapter = build(fake_pool(), env())
    try:
        rows = _step(adapter, ["a", "b"]).tolist()
        for r in rows:  # both hold the shared pages resident, each in its own reserve blocks
            adapter.engine.open_tail_page(r)
        for r in rows:
            recall_now(adapter.engine, [RecallRequest(r, adapter.engine.gen(r), (0, 1), (1.0, 1.0))])
        _step(adapter, ["a", "b"])
        own = [_own_cells(adapter, r) for r in rows]
        assert all(bool((o >= 0).all()) for o in own) and not set(own[0].tolist()) & set(own[1].tolist())
        got = adapter.cells_of(_picks(["a", "b"]))
        assert torch.equal(got[0], own[0]) and torch.equal(got[1], own[1])  # each its own copy
        # "a" finishes: "b"'s picks on the shared pages still name its own resident cells
        _step(adapter, ["b"])
        got = adapter.cells_of(_picks(["b"]))
        assert torch.equal(got[0], own[1]) and torch.equal(_own_cells(adapter, rows[1]), own[1])
    finally:
        adapter.close()


def test_a_page_keeps_its_entries_while_any_row_maps_it():
    m = LocMap(n_locs=16 * 4, page_chunks=4, no_chunk=999, device=torch.device("cpu"), max_rows=3, max_pages=4)
    m.map(0, [3, 1], [10, 11])
    m.map(1, [3, 1, 7], [20, 21, 22])  # shares pool pages 3 and 1
    m.set_batch([1, 0])
    locs = torch.tensor([[3 * 4 + 1, 1 * 4 + 2, 7 * 4], [3 * 4 + 1, 1 * 4 + 2, 7 * 4]])
    assert m.batch_chunks(locs).tolist() == [[20 * 4 + 1, 21 * 4 + 2, 22 * 4], [10 * 4 + 1, 11 * 4 + 2, 999]]
    m.unmap(1)
    assert int(m.table[3 * 4]) == 10 * 4 and int(m.table[7 * 4]) == 999  # the survivor's mirror page; 7 is gone
    m.set_batch([0])
    assert m.batch_chunks(locs[:1]).tolist() == [[10 * 4 + 1, 11 * 4 + 2, 999]]
    m.unmap(0)
    assert bool((m.table[:-1] == 999).all()) and bool((m.chunk == -1).all())


@pytest.mark.parametrize("mode", ["copy", "shrink"])
def test_the_loc_map_never_blocks_the_decode_thread(mode, monkeypatch):
    """Mapping pages (admission, page opens), unmapping (a finish), the batch's row map and the settle's loc
    lookup go through page-locked staging: under the CUDA stand-in that counts what a GPU host waits for, nothing
    in loc_map.py blocks the decode thread but the settle's listed read of the closed chunks' bytes."""
    from flashmemory.bench import step_drive as sd
    from tests.support.cuda_standin import count_blocking

    count_blocking(monkeypatch)
    world = sd.build_world(mode, rows=4, pages=6, layers=3, interval=4, page_kmax=2, reserve_pages=16, last_keep=64)
    got = []
    try:
        sd.admit(world, "a", 4 * sd.PAGE - 9)
        sd.admit(world, "b", 4 * sd.PAGE - 9)
        for k in range(12):  # page 4 opens at step 10; "late" joins at 3, "b" leaves at 8
            if k == 3:
                sd.admit(world, "late", 2 * sd.PAGE + 50)
            if k == 8:
                sd.finish(world, "b")
            got += sd.step(world)[1]
    finally:
        sd.close(world)
    assert got, "the stand-in logged nothing: is it counting?"
    mine = [f"{b.kind} {b.function} {b.where}" for b in got if b.where.startswith("sglang/decode/loc_map.py")]
    # pool_chunks' read of the closed chunks' bytes (copy mode's settle) is a listed one (test_decode_blocking)
    assert not [w for w in mine if not w.startswith("d2h pool_chunks")], mine
