"""Copy and shrink are two subclasses of one complete base (`offload_adapter.OffloadAdapter`), and begin_step
crosses into the core once per decode step (`OffloadEngine.sync_batch`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from flashmemory.sglang.decode.copy_adapter import CopyAdapter
from flashmemory.sglang.decode.offload_adapter import OffloadAdapter
from flashmemory.sglang.decode.shrink_adapter import ShrinkAdapter
from flashmemory.sglang.decode.tables import c4_page_table
from tests.sglang.decode.test_copy_adapter import PAGE, env, fake_pool

pytestmark = pytest.mark.sglang
PKG = Path(__file__).resolve().parents[3] / "flashmemory" / "sglang"


def called_on_adapter() -> set[str]:
    """Attribute names the hooks, the runtime and the metrics read off the adapter (`engine.X`, `RUNTIME.engine.X`,
    `self.engine.X`)."""
    names = set()
    for f in ("decode/hooks.py", "decode/runtime.py", "metrics/prometheus.py"):
        for node in ast.walk(ast.parse((PKG / f).read_text())):
            on = isinstance(node, ast.Attribute) and ast.unparse(node.value) in (
                "engine",
                "RUNTIME.engine",
                "self.engine",
            )
            if on:
                names.add(node.attr)
    return names


def test_the_base_declares_everything_its_callers_use() -> None:
    base = OffloadAdapter(fake_pool(), env())  # instance attributes too (rows, l1, indexers)
    used = called_on_adapter()
    assert {"begin_step", "cells_of", "settle", "index_in_reserve", "level1", "rows", "l1"} <= used
    missing = sorted(n for n in used if not hasattr(base, n))
    assert not missing, f"called on the adapter but not defined by OffloadAdapter: {missing}"
    own = [c for c in OffloadAdapter.__mro__ if c is not object]  # the base and its mixins (adapter_level1)
    for n in used:  # methods are the base's own, not left for a subclass to add
        assert not callable(getattr(OffloadAdapter, n, None)) or any(n in vars(c) for c in own), n
    base.close()


def test_copy_and_shrink_are_siblings() -> None:
    assert issubclass(CopyAdapter, OffloadAdapter) and issubclass(ShrinkAdapter, OffloadAdapter)
    assert not issubclass(ShrinkAdapter, CopyAdapter) and not issubclass(CopyAdapter, ShrinkAdapter)


def test_the_base_defaults_are_no_ops() -> None:
    base = OffloadAdapter(fake_pool(), env())
    locs = torch.tensor([3, 70])
    reserve = base.engine.reserve.kv.clone()
    base.refresh_from_pool(0, locs)
    base.on_c4_store(0, locs)
    base.begin_forward(True)
    base.end_extend()
    base.settle()
    assert torch.equal(reserve, base.engine.reserve.kv)
    assert base.mirror_buf_infos() == {} and base.host_ptrs() == set() and not base.index_in_reserve(0)
    assert base.drop_sink(locs) is locs and base.store_cells(locs) is locs and base.reserve_index(0) is None
    assert base.stats()["device_bytes_saved"] == 0.0
    base.close()


def test_begin_step_crosses_into_the_core_once() -> None:
    """Every lifecycle call (finish, admit, tail page, warm start, add_pages, appends) runs inside one
    sync_batch: the adapter calls none of them itself."""
    eng = CopyAdapter(fake_pool(), env())
    core = eng.engine
    calls: list[str] = []
    inside = [False]

    def spy(name):
        fn = getattr(core, name)

        def wrapped(*a, **k):
            calls.append(name if inside[0] or name == "sync_batch" else f"direct {name}")
            if name != "sync_batch":
                return fn(*a, **k)
            inside[0] = True
            try:
                return fn(*a, **k)
            finally:
                inside[0] = False

        setattr(core, name, wrapped)

    for name in ("sync_batch", "finish", "admit", "open_tail_page", "add_pages", "decode_append", "n_chunks", "gen"):
        spy(name)
    r2t = torch.full((2, 4 * PAGE), -1, dtype=torch.int64)
    r2t[0] = torch.arange(4 * PAGE) + 4 * PAGE
    for step, rids in enumerate((["a"], ["a"], [])):
        seq = torch.tensor([2 * PAGE + 3 + step])[: len(rids)]
        table = (
            c4_page_table(r2t, torch.tensor([0])[: len(rids)], seq, PAGE)
            if rids
            else torch.empty((0, 1), dtype=torch.int64)
        )
        calls.clear()
        eng.begin_step(rids, table, seq)
        assert calls and calls.count("sync_batch") == 1 and not [c for c in calls if c.startswith("direct")], calls
    assert core.snapshot_rows() == {} and eng.rows == {}
    eng.close()
