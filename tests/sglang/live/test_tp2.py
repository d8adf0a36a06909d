"""FlashMemory at --tp 2 on CPU (gloo): every rank publishes the same resident set at the same decode step, and a
request that fails on one rank fails on both.

Three TP=2 servers of a small-init copy of the tiny DSv4 (init_std 0.02: far less chaotic than the default
weights, so bf16 rounding does not flip greedy tokens between runs that compute the same bits): stock (the CPU
layer only); FlashMemory at a full budget with Level 1 cycling every 4 steps; FlashMemory at a three-page budget
(of the requests' 5-6 pages).
Both FlashMemory servers run the Level-1 worker late on rank 1 only (FLASHMEMORY_LEVEL1_DELAY, test only): with
publishing tied to the worker's timing rank 1 would attend over other pages than rank 0. The small-budget server
also faults requests named faulty-* on rank 1 only (FLASHMEMORY_FAULT_INJECT ... rank=1).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.sglang.live.conftest import prompt, server_trio, side_by_side, small_init_model

TP2 = ("--tp", "2")
LATE_RANK1 = {"FLASHMEMORY_LEVEL1_DELAY": "ms=600,rank=1"}
# Keys of the adapter's stats that the resident set decides (not wall time): equal on both ranks in lockstep.
PLAN_KEYS = (
    "recall_pages",
    "recall_bytes",
    "warm_start_pages",
    "level1_cycles",
    "resident_fraction",
    "reserve_used_fraction",
)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, live_logs, tiny_retriever_ckpt):
    model = small_init_model(tmp_path_factory, "tp2")
    stats = tmp_path_factory.mktemp("tp2_stats") / "small.json"
    ckpt = {"SGLANG_RETRIEVER_INLINE_CKPT": tiny_retriever_ckpt}
    small = {
        **LATE_RANK1,
        **ckpt,
        "FLASHMEMORY_FAULT_INJECT": "hook=before_forward,rid=^faulty-,rank=1",
        "FLASHMEMORY_STATS_FILE": str(stats),
    }
    with server_trio(model, live_logs, "tp2", TP2, {**LATE_RANK1, **ckpt}, small) as servers:
        yield {**servers, "stats": stats}


def test_full_budget_with_late_level1_on_one_rank_equals_stock(tp2):
    ids = [prompt(300, 5), prompt(700, 6)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    ref, got = side_by_side(lambda: tp2["stock"].post("/generate", body), lambda: tp2["full"].post("/generate", body))
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
    metrics = tp2["full"].get_text("/metrics")
    cycles = [float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("flashmemory_level1_cycles_total")]
    assert cycles and cycles[0] > 0, "Level 1 never cycled on the full-budget TP=2 server"


def read_ranks(stats: Path) -> tuple[dict, dict]:
    return tuple(json.loads(p.read_text()) for p in (stats, Path(f"{stats}.rank1")))


def test_small_budget_ranks_publish_the_same_plans(tp2):
    srv, stats = tp2["small"], tp2["stats"]
    out = srv.post(
        "/generate",
        {
            "input_ids": [prompt(1100, 11), prompt(1300, 12)],
            "sampling_params": {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True},
        },
    )
    assert all(len(r["output_ids"]) == 20 for r in out)
    time.sleep(1.0)  # both ranks wrote their last decode step's stats
    r0, r1 = read_ranks(stats)
    assert r0["decode_forwards"] == r1["decode_forwards"] > 0
    assert r0["level1_cycles"] > 0 and r0["recall_pages"] > r0["warm_start_pages"]  # cycles did recall pages
    assert 0 < r0["resident_fraction"] < 1  # a real budget, not all
    assert {k: r0[k] for k in PLAN_KEYS} == {k: r1[k] for k in PLAN_KEYS}


def test_a_failure_on_one_rank_fails_the_request_on_both_without_a_hang(tp2):
    from flashmemory.serve.cpu_server import ServerError

    srv = tp2["small"]
    body = {
        "input_ids": prompt(200, 23),
        "rid": "faulty-1",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    }
    with pytest.raises(ServerError, match="HTTP 500") as err:
        srv.post("/generate", body, timeout_s=300)
    assert "before_forward" in str(err.value)
    after = srv.generate(prompt(200, 24), 6, timeout_s=300)  # both ranks go on: the next request is served
    assert len(after["output_ids"]) == 6
    log = srv.log.read_text(errors="replace")
    assert "faulty-1 failed in before_forward (fault injected" in log  # rank 1 found it
    assert "(on TP rank 1)" in log  # rank 0 learned of it
