"""Tensor-parallel guard: a request that fails on one rank fails on every rank, in the same batch, and no rank
hangs. Two real gloo processes (the exchange sglang's TP cpu group would run), each with its own `Guard`."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest

from flashmemory.sglang.decode.guard import Guard
from flashmemory.sglang.decode.guard_tp import gloo_exchange

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")
INJECT = "hook=before_forward,rid=^bad,rank=1"  # the fault fires on rank 1 only


class _Req:
    def __init__(self, rid: str):
        self.rid, self.to_finish = rid, None

    def finished(self) -> bool:
        return False


class _Batch:
    def __init__(self, rids: list[str]):
        import torch

        self.rids, self.seq_lens = rids, torch.full((len(rids),), 8)


def rank_main(rank: int, init: str, out: "mp.Queue") -> None:
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        stops: list[str] = []
        g = Guard(
            stop=stops.append, hook_names=("before_forward",), exchange=gloo_exchange(dist.group.WORLD, 2), rank=rank
        )
        g.configure({"FLASHMEMORY_FAULT_INJECT": INJECT})
        seen = []
        steps = []
        for step in range(3):  # three batches: ok-only, then "bad-1" joins, then it is gone
            rids = ["ok-1"] + (["bad-1"] if step == 1 else [])
            reqs = [_Req(r) for r in rids]
            g.run(
                "before_forward",
                lambda b: seen.append(list(g.without_failed(b).rids)),
                (_Batch(rids),),
                {},
                lambda a, k: a[0].rids,
            )
            g.abort_failed(reqs)  # before the batch's result: every rank, every batch (a collective)
            steps.append({r.rid: r.to_finish is not None for r in reqs})
            if step == 1:
                failed = {rid: f.reason for rid, f in g.failed.items()}
        out.put((rank, steps, seen, stops, failed))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc(), None, None))


def test_a_failure_on_one_rank_fails_the_request_on_both(tmp_path) -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=rank_main, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = {}
        for _ in procs:
            rank, steps, seen, stops, failed = out.get(timeout=120)  # a hung collective fails here
            assert steps != "error", seen
            res[rank] = (steps, seen, stops, failed)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                os.kill(p.pid, 9)
    for rank in (0, 1):
        steps, seen, stops, failed = res[rank]
        assert steps == [{"ok-1": False}, {"ok-1": False, "bad-1": True}, {"ok-1": False}], (rank, steps)
        assert not stops and list(failed) == ["bad-1"]
    assert "on TP rank 1" in res[0][3]["bad-1"] and "on TP rank" not in res[1][3]["bad-1"]
    assert res[1][1][1] == ["ok-1", "\x00flashmemory-failed:bad-1"]  # rank 1 released it at once
    assert res[0][1][1] == ["ok-1", "bad-1"]  # rank 0 learned of it at the result


def test_one_rank_shares_nothing() -> None:
    g = Guard(stop=lambda m: None, hook_names=("before_forward",), configured=True)
    g.fail("x", "before_forward", "r")
    g.share()
    assert g.unshared == [] and list(g.failed) == ["x"]


def test_test_only_knobs_name_a_rank() -> None:
    from flashmemory.env import EnvError, fault_inject, level1_delay

    assert fault_inject({"FLASHMEMORY_FAULT_INJECT": INJECT}).rank == 1
    assert fault_inject({"FLASHMEMORY_FAULT_INJECT": "hook=before_forward,rid=x"}).rank is None
    with pytest.raises(EnvError, match="FLASHMEMORY_FAULT_INJECT.*rank must be"):
        fault_inject({"FLASHMEMORY_FAULT_INJECT": "hook=before_forward,rid=x,rank=one"})
    d = level1_delay({"FLASHMEMORY_LEVEL1_DELAY": "ms=250,rank=1"})
    assert (d.seconds, d.rank) == (0.25, 1) and level1_delay({}) is None
    with pytest.raises(EnvError, match="FLASHMEMORY_LEVEL1_DELAY"):
        level1_delay({"FLASHMEMORY_LEVEL1_DELAY": "seconds=1"})


def test_the_injector_fires_on_its_rank_only() -> None:
    for rank, fires in ((0, False), (1, True)):
        g = Guard(stop=lambda m: None, hook_names=("before_forward",), exchange=lambda mine: [], rank=rank)
        g.configure({"FLASHMEMORY_FAULT_INJECT": INJECT})
        assert (g.inject is not None) == fires
