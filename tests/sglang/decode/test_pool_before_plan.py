"""Before a request's first Level-1 plan publishes it attends its whole c4 history (copy mode), as stock does.

A request is admitted with its warm start (the newest KMAX pages) and its first Level-1 cycle needs the hidden
state of its first decode forward, so the cycle publishes some steps later. Copy mode keeps every page in sglang's
pool: until that publish the request's indexer sees the whole history (stock's view), its picks stay pool locs and
attention reads the pool (`Runtime.pool_rows`). Shrink mode keeps the history in host DRAM and cannot; a CUDA
graph bakes the reserve read in. Driven on the synthetic pool of `flashmemory.bench.step_drive`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flashmemory.bench import step_drive as sd
from flashmemory.sglang.decode import hooks
from flashmemory.sglang.decode.resident_topk import resident_view

pytestmark = pytest.mark.sglang
PAGE = sd.PAGE
SEQ = 5 * PAGE + 10  # 1290 tokens: 322 c4 chunks on 6 pages


@dataclass
class _Md:
    """The two fields of sglang's indexer metadata the score-resident view replaces."""

    page_table: torch.Tensor
    compressed_seq_lens: torch.Tensor


class _Late:
    """Level-1 scores that keep the oldest page (page 0) in the plan."""

    def __call__(self, row: int, n_hist: int, hidden: object, position: torch.Tensor) -> torch.Tensor:
        s = torch.zeros(n_hist)
        s[:64] = 1.0
        return s


def _world(mode: str, **kw):
    kw = {"page_kmax": 2, "interval": 4, "last_keep": 2, "score_resident": True, "async_recall": False} | kw
    world = sd.build_world(mode, rows=2, pages=8, layers=2, **kw)
    world.adapter.l1.scorer = _Late()
    world.rt.features = ("path_p", "level2", "level1")
    sd.admit(world, "a", SEQ)
    return world


def _view(world) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's view of the batch this forward (hooks' score-resident metadata for c4 layer 0)."""
    rt = world.rt
    fb = sd.batch(world)
    table = rt.engine.pages[rt.engine.rows["a"]]
    md = _Md(torch.tensor([table], dtype=torch.int32), torch.tensor([SEQ // 4], dtype=torch.int32))
    rt.fwd.view_cache = None
    assert fb.rids == ["a"]
    view = hooks._resident_metadata(md, 0)
    return view.page_table, view.compressed_seq_lens


def _before(world) -> None:
    fb = sd.batch(world)
    world.rt.before_forward(fb, world.r2t)


def _after(world) -> None:
    fb = sd.batch(world)
    world.rt.after_decode_forward(fb)
    world.adapter.l1.wait()
    for r in world.seqs:
        world.seqs[r] += 1


def test_copy_mode_request_sees_its_whole_history_until_its_first_plan(monkeypatch):
    world = _world("copy")
    monkeypatch.setattr(hooks, "RUNTIME", world.rt)
    try:
        _before(world)  # admission: the warm start holds the newest 2 pages
        table, lens = _view(world)
        assert int(lens[0]) == SEQ // 4, "the indexer must see all 322 chunks before the first plan"
        assert table[0, :6].tolist() == world.adapter.pages[world.adapter.rows["a"]][:6]
        assert world.rt.fwd.pool_rows.tolist() == [True]  # so attention reads the pool, picks stay pool locs
        _after(world)  # the first cycle runs on this step's hidden state and publishes (synchronous here)
        _before(world)
        assert world.rt.fwd.pool_rows is None, "a planned request reads its resident pages from the reserve"
        table, lens = _view(world)
        assert int(lens[0]) < SEQ // 4
        resident = world.adapter.step_resident_pages()[0].tolist()
        assert 0 in resident, resident  # the plan's page 0, which the warm start did not hold
    finally:
        sd.close(world)


def test_attention_reads_the_pool_while_a_row_is_unplanned_then_the_reserve(monkeypatch):
    world = _world("copy")
    monkeypatch.setattr(hooks, "RUNTIME", world.rt)
    pool_buf = torch.zeros(4, dtype=torch.uint8)
    try:
        for planned in (False, True):
            _before(world)
            world.rt.fwd.attn_layer = 0
            got = hooks.around_get_extra_key_buffer(lambda self, layer_id: pool_buf, world.rt.pool, 0)
            reserve = world.adapter.reserve_kv(0)
            assert (got.data_ptr() == reserve.data_ptr()) is planned, planned
            assert (got is pool_buf) is not planned
            world.rt.fwd.attn_layer = None
            _after(world)
    finally:
        sd.close(world)


@pytest.mark.parametrize("mode,features", [("shrink", ()), ("copy", ("cudagraph",)), ("copy", ("mask",))])
def test_modes_that_cannot_keep_the_warm_start(mode, features, monkeypatch):
    world = _world(mode)
    world.rt.features += features
    monkeypatch.setattr(hooks, "RUNTIME", world.rt)
    try:
        _before(world)
        assert world.rt.fwd.pool_rows is None
        assert world.adapter.unplanned_rows() == [True]
    finally:
        sd.close(world)


def test_warm_start_is_not_a_plan_and_a_cycle_that_recalls_nothing_is():
    world = _world("copy")
    world.adapter.l1.scorer = lambda row, n, h, p: torch.zeros(n)  # the recency tail alone: already resident
    try:
        _before(world)
        assert world.adapter.unplanned_rows() == [True]
        _after(world)
        _before(world)
        assert world.adapter.unplanned_rows() == [False]
    finally:
        sd.close(world)


def test_pool_picks_keep_every_pick_of_a_full_row_and_the_resident_ones_of_the_others():
    world = _world("copy")
    sd.admit(world, "b", SEQ)
    try:
        _before(world)
        ad = world.adapter
        pages = {rid: ad.pages[ad.rows[rid]] for rid in ("a", "b")}
        resident = ad.step_resident_pages().tolist()
        old = [pages[r][0] * 64 + 3 for r in ("a", "b")]  # page 0: not in the warm start
        new = [pages[r][5] * 64 + 1 for r in ("a", "b")]  # the newest page: resident
        assert 0 not in resident[0] and 5 in resident[1]
        locs = torch.tensor([[old[0], new[0], -1], [old[1], new[1], -1]], dtype=torch.int64)
        got = ad.pool_picks(locs, torch.tensor([True, False]))
        assert got.tolist() == [[old[0], new[0], -1], [-1, new[1], -1]]
    finally:
        sd.close(world)


def test_resident_view_full_rows_are_stocks_view():
    table = torch.tensor([[7, 3, 9, 4], [5, 2, 8, -1]], dtype=torch.int32)
    lens = torch.tensor([200, 130], dtype=torch.int32)
    sel = torch.tensor([[0, -1], [1, -1]])
    vt, vl = resident_view(table, lens, sel, full=torch.tensor([True, False]))
    assert vt[0].tolist() == [7, 3, 9, 4] and int(vl[0]) == 200
    assert vl[1].item() == 64 + 2  # page 1 and the tail page 2 (2 chunks)
    assert vt[1, :2].tolist() == [2, 8]
