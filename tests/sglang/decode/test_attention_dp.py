"""Attention data parallelism (`--tp 4 --attn-dp-size 2`: two DP ranks, each a batch of its own run by an
attention-TP group of two), proven without a live server: FlashMemory's lockstep width and failure exchange span
the attention-TP group only (size 1 when --tp equals the DP size), a fault on one DP rank fails only its request
and no rank waits on another DP rank's batches (four gloo processes, each with its own guard), and the idle
forwards a DP rank without requests runs pass through every hook without touching the engine.

sglang's own choice of group is used (`sglang.srt.layers.dp_attention.get_dp_tp_group`); only its parallel state
(`get_parallel`, which a server fills when it builds its process groups) is a stand-in here."""

from __future__ import annotations

import multiprocessing as mp
import traceback
import types

import pytest
import torch

from flashmemory.sglang.decode import hooks, shrink_hooks
from flashmemory.sglang.decode.core_config import batch_group, core_config, serving_tp_size
from flashmemory.sglang.decode.guard import Guard
from flashmemory.sglang.decode.runtime import Runtime
from tests.sglang.decode.test_copy_adapter import env

pytestmark = pytest.mark.sglang
dpa = pytest.importorskip("sglang.srt.layers.dp_attention")
INJECT = "hook=before_forward,rid=^bad,rank=1"  # TP rank 1 only: in DP rank 0's attention-TP group {0, 1}


def parallel(tp: int, attn_dp: int, tp_rank: int = 0, groups: tuple = (None, None)) -> types.SimpleNamespace:
    """sglang's parallel state as a server with --tp `tp` --attn-dp-size `attn_dp` fills it (GroupCoordinator-
    shaped groups: world_size, rank_in_group, cpu_group)."""
    attn_tp = tp // attn_dp
    return types.SimpleNamespace(
        attn_dp_enabled=attn_dp > 1,
        tp_group=types.SimpleNamespace(world_size=tp, rank_in_group=tp_rank, cpu_group=groups[0]),
        attn_tp_group=types.SimpleNamespace(world_size=attn_tp, rank_in_group=tp_rank % attn_tp, cpu_group=groups[1]),
    )


@pytest.mark.parametrize("tp, attn_dp, width", [(2, 1, 2), (2, 2, 1), (4, 2, 2), (8, 8, 1)])
def test_lockstep_spans_the_ranks_of_one_batch(tp, attn_dp, width, monkeypatch):
    """Level 1 publishes in lockstep (a publish lag) only where several ranks run the same batch."""
    monkeypatch.setattr(dpa, "get_parallel", lambda: parallel(tp, attn_dp))
    assert serving_tp_size() == width
    assert batch_group().world_size == width
    geo = types.SimpleNamespace(page_chunks=64, n_c4_layers=2, index_head_dim=128, n_locs=4096, n_pages=64)
    lag = core_config(env(""), geo, tp_size=serving_tp_size()).level1.publish_lag
    assert (lag > 0) == (width > 1)


def _rank_main(rank: int, init: str, out: "mp.Queue") -> None:
    """One scheduler rank of --tp 4 --attn-dp-size 2: DP rank 0 (TP ranks 0, 1) runs three batches, the second
    with bad-a; DP rank 1 (TP ranks 2, 3) runs one batch with bad-b, then only idle forwards (no batch result)."""
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
        attn = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # every rank builds every group
        dpa.get_parallel = lambda: parallel(4, 2, rank, (dist.group.WORLD, attn))
        import sglang.srt.distributed as sd

        sd.get_tp_group = lambda: parallel(4, 2, rank, (dist.group.WORLD, attn)).tp_group
        stops: list[str] = []
        g = Guard(stop=stops.append, hook_names=("before_forward",))
        g.configure({"FLASHMEMORY_FAULT_INJECT": INJECT})  # the exchange is built here, from sglang's group
        mine = ["a", "bad-a"] if rank < 2 else ["b", "bad-b"]
        batches = [[mine[0]], mine, [mine[0]]] if rank < 2 else [mine]
        steps = []
        for rids in batches:
            reqs = [types.SimpleNamespace(rid=r, to_finish=None, finished=lambda: False) for r in rids]
            fb = types.SimpleNamespace(rids=rids, seq_lens=torch.full((len(rids),), 8))
            g.run("before_forward", lambda b: None, (fb,), {}, lambda a, k: a[0].rids)
            g.abort_failed(reqs)  # before the batch's result: a collective of this DP rank's ranks
            steps.append(sorted(r.rid for r in reqs if r.to_finish is not None))
        out.put((rank, g.rank, steps, stops))
        dist.barrier()  # every rank's steps are in before any group goes away
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, None, traceback.format_exc(), None))


def test_a_fault_on_one_dp_rank_fails_only_its_request_and_no_rank_waits_on_another(tmp_path) -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, f"file://{tmp_path / 'rdv'}", out)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        res = {}
        for _ in procs:
            rank, g_rank, steps, stops = out.get(timeout=120)  # an exchange across DP ranks would hang here
            assert g_rank is not None, steps
            res[rank] = (g_rank, steps, stops)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert {r: v[0] for r, v in res.items()} == {0: 0, 1: 1, 2: 2, 3: 3}  # the injector's rank= is the TP rank
    assert res[0][1] == res[1][1] == [[], ["bad-a"], []]  # failed on rank 1, aborted on both ranks of DP rank 0
    assert res[2][1] == res[3][1] == [[]]  # DP rank 1: its bad-b is not rank 1's, nothing of DP rank 0's reaches it
    assert all(not v[2] for v in res.values())  # no rank stopped its server


class _Engine:
    """An engine that records every call made on it (an idle forward must make none)."""

    mode = "shrink"
    extend_reads_reserve = True
    rows = 0

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        return lambda *a, **k: self.calls.append(name)


def test_idle_forwards_pass_through_every_hook_untouched(monkeypatch):
    """A DP rank without requests runs ForwardMode.IDLE forwards (empty batches, for the MoE collectives): every
    hook hands them to sglang's own code with the same arguments and touches no engine state."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rt = Runtime()
    rt.configure(env("", decode_max_conc=4), ("level2", "path_p", "level1", "shrink"))
    monkeypatch.setattr(hooks, "RUNTIME", rt)
    rt.guard = Guard(hook_names=hooks.HOOK_NAMES)
    engine, pool = _Engine(), types.SimpleNamespace()
    rt.engine, rt.pool = engine, pool
    empty = torch.empty(0, dtype=torch.int64)
    fb = types.SimpleNamespace(
        forward_mode=ForwardMode.IDLE, rids=[], seq_lens=empty, seq_lens_cpu=empty, req_pool_indices=empty
    )
    runner = types.SimpleNamespace(is_draft_worker=False, req_to_token_pool=types.SimpleNamespace(req_to_token=empty))
    backend = types.SimpleNamespace(token_to_kv_pool=pool, forward_metadata=None)
    seen = []

    def original(*args, **kwargs):
        seen.append(args)
        return "stock"

    x, layer, comp = torch.zeros(0, 8), types.SimpleNamespace(layer_id=1), types.SimpleNamespace(ratio=4)
    hooks.before_forward(runner, fb)
    assert hooks.around_forward_c4_indexer(original, backend, x, x, layer, fb) == "stock"
    assert hooks.around_attention(original, backend, x, x, x, layer, fb) == "stock"
    assert shrink_hooks.around_compress(original, backend, x, fb, 1, comp) == "stock"
    hooks.after_forward(None, runner, fb)
    assert rt.admission_refusals(fb) == []
    assert engine.calls == []  # nothing reached the engine
    assert seen == [(backend, x, x, layer, fb), (backend, x, x, x, layer, fb), (backend, x, fb, 1, comp)]
    assert rt.counters.get("indexer_calls_eager", 0) == 0 and rt.steps == 0 and not rt.guard.failed
