"""Lockstep Level 1: stand-in tensor-parallel ranks with skewed worker timing publish the same resident set at the
same decode step (and, as a control, asynchronous publishing does not)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, check_invariants
from flashmemory.residency.level1 import Level1, Level1Config
from flashmemory.retriever.fp8 import quantize_chunks

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
ROWS, STEPS, TAU = (0, 1), 12, 2


class TopPages:
    """Policy: the `budget` pages with the best chunk score (ascending page ids)."""

    def __call__(self, scores: torch.Tensor, n_hist: int, budget: int) -> torch.Tensor:
        n_pages = -(-n_hist // 4)
        pad = torch.full((n_pages * 4,), float("-inf"))
        pad[:n_hist] = scores[:n_hist]
        return pad.view(n_pages, 4).amax(1).topk(min(budget, n_pages)).indices.sort().values


class GatedScorer:
    """Scores that move with the step carried in the hidden state (so every cycle changes the selection). With
    `gated`, a cycle submitted at step s blocks until `gates[s]` is set: a worker late by as much as the driver
    chooses."""

    def __init__(self, gated: bool):
        self.gated, self.gates = gated, [threading.Event() for _ in range(STEPS)]

    def __call__(self, row: int, n: int, hidden: dict, pos: torch.Tensor) -> torch.Tensor:
        step = int(hidden[1][0])
        if self.gated and not self.gates[step].wait(10):
            raise TimeoutError("gate never released")
        return ((torch.arange(n) * 7 + step * 13 + row * 5) % n).float() / n

    def release_all(self) -> None:
        for g in self.gates:
            g.set()


def rank(cfg: Level1Config, gated: bool) -> tuple[OffloadEngine, Level1, GatedScorer]:
    torch.manual_seed(0)  # both ranks hold the same bytes (replicated KV and index-K)
    eng = OffloadEngine(
        LAYOUT, EngineConfig(max_rows=2, max_chunks=64, recall_blocks=8, decode_pages=1, max_resident_pages=3)
    )
    for row in ROWS:
        n = 30
        eng.admit(
            row,
            torch.randint(0, 256, (3, n, 8), dtype=torch.uint8),
            torch.stack([quantize_chunks(torch.randn(n, 4)) for _ in range(3)]),
        )
    scorer = GatedScorer(gated)
    return eng, Level1(eng, scorer, TopPages(), cfg), scorer


def resident(eng: OffloadEngine) -> dict[int, tuple[int, ...]]:
    return {row: tuple(sorted(eng.rows[row].recall)) for row in ROWS}


def settle(l1: Level1, left: int) -> None:
    """Until the worker holds at most `left` unfinished cycles (bounded: a hang fails the test)."""
    t0 = time.monotonic()
    while l1.queued() > left:
        assert time.monotonic() - t0 < 10, "worker stuck"
        time.sleep(0.002)


def drive(cfg: Level1Config) -> tuple[list, list]:
    """Rank 0's worker finishes every cycle before the next step; rank 1's finishes each one a step later. Returns
    each rank's resident set after every step's Level-1 call."""
    (e0, l0, _), (e1, l1, s1) = rank(cfg, gated=False), rank(cfg, gated=True)
    seen0, seen1 = [], []
    try:
        for step in range(STEPS):
            hid = {1: torch.full((2, 8), float(step))}
            pos = torch.tensor([30, 30])
            l0.on_step(list(ROWS), hid, pos)
            settle(l0, 0)
            seen0.append(resident(e0))
            new = l1.on_step(list(ROWS), hid, pos)
            seen1.append(resident(e1))
            for g in s1.gates[:step]:  # the earlier steps' cycles may finish now, this step's stays late
                g.set()
            settle(l1, 1 if new else 0)
        l0.wait()
        l1.wait()
    finally:
        s1.release_all()
        l0.close()
        l1.close()
    assert not check_invariants(e0) and not check_invariants(e1)
    assert e0.metrics()["total"]["recall_pages"] > 0
    return seen0, seen1


def test_lockstep_ranks_publish_the_same_set_at_the_same_step():
    seen0, seen1 = drive(Level1Config(tau=TAU, max_resident_pages=3, last_keep=0, publish_lag=2))
    assert seen0 == seen1  # exact: both ranks score with one integer-valued function on the same bytes (same bits)
    assert len({tuple(s.items()) for s in seen0}) > 2  # the set did change over the run


def test_async_publishing_diverges_under_skew():
    """Control: without lockstep the late rank publishes a step later, so the ranks disagree at some step."""
    seen0, seen1 = drive(Level1Config(tau=TAU, max_resident_pages=3, last_keep=0, publish_lag=0))
    assert seen0 != seen1


def test_a_cycle_failure_surfaces_at_its_publish_step():
    eng, l1, scorer = rank(
        Level1Config(tau=TAU, max_resident_pages=3, last_keep=0, publish_lag=2, async_recall=False), gated=False
    )

    def bad(row, n, hidden, pos):
        raise ValueError("scores")

    l1.scorer = bad
    hid, pos = {1: torch.zeros(2, 8)}, torch.tensor([30, 30])
    l1.on_step(list(ROWS), hid, pos)  # tick 1: submitted (scored inline, failed)
    l1.on_step(list(ROWS), hid, pos)  # tick 2: nothing due yet
    with pytest.raises(RuntimeError) as err:
        l1.on_step(list(ROWS), hid, pos)  # tick 3 = 1 + lag: the failure is raised here, on every rank alike
    assert isinstance(err.value.__cause__, ValueError)
    l1.close()


def test_serving_config_publishes_in_lockstep_under_tensor_parallelism():
    """The serving edge turns lockstep on exactly when the server runs more than one TP rank."""
    from flashmemory.env import FlashMemoryEnv
    from flashmemory.sglang.decode.core_config import TP_PUBLISH_LAG, core_config
    from flashmemory.sglang.decode.geometry import PoolGeometry

    geo = PoolGeometry(
        n_c4_layers=4, n_pages=50, page_chunks=64, kv_page_bytes=37440, index_head_dim=128, index_page_bytes=8448
    )
    env = FlashMemoryEnv.from_environ({"SGLANG_RETRIEVER_INTERVAL": "7", "SGLANG_RETRIEVER_INLINE_LAYERS": "1"})
    assert core_config(env, geo).level1.publish_lag == 0
    assert core_config(env, geo, tp_size=2).level1.publish_lag == TP_PUBLISH_LAG == 2
    one = FlashMemoryEnv.from_environ({"SGLANG_RETRIEVER_INTERVAL": "1", "SGLANG_RETRIEVER_INLINE_LAYERS": "1"})
    assert core_config(one, geo, tp_size=8).level1.publish_lag == 1  # never beyond tau: no cycle is skipped


def test_a_step_without_rows_still_counts():
    """A rank whose batch has no Level-1 row at some step (its request failed there first) keeps the same clock."""
    (e0, l0, _), (e1, l1, _) = (
        rank(Level1Config(tau=TAU, max_resident_pages=3, last_keep=0, publish_lag=2, async_recall=False), gated=False)
        for _ in range(2)
    )
    hid, pos = {1: torch.full((2, 8), 3.0)}, torch.tensor([30, 30])
    seen = []
    for step in range(4):
        l0.on_step(list(ROWS), hid, pos) if step == 0 else l0.on_step([-1, -1], hid, pos)
        l1.on_step(list(ROWS), hid, pos) if step == 0 else l1.tick()
        seen.append((resident(e0), resident(e1)))
    assert all(a == b for a, b in seen) and seen[1] != seen[2]  # published at the third call on both
    l0.close()
    l1.close()


def test_the_serving_edge_reads_sglangs_tp_size(monkeypatch):
    """`serving_tp_size` asks sglang for the ranks that run this batch (its TP group without attention DP; 1
    outside a server), the size the adapter hands `core_config`."""
    import types

    dpa = pytest.importorskip("sglang.srt.layers.dp_attention")
    from flashmemory.sglang.decode.core_config import serving_tp_size

    tp2 = types.SimpleNamespace(world_size=2)
    monkeypatch.setattr(dpa, "get_parallel", lambda: types.SimpleNamespace(attn_dp_enabled=False, tp_group=tp2))
    assert serving_tp_size() == 2

    def no_group():
        raise RuntimeError("parallel name 'tp_group' has not been written in this process")

    monkeypatch.setattr(dpa, "get_parallel", no_group)
    assert serving_tp_size() == 1
