"""FlashMemory under attention data parallelism on CPU: `--tp 2 --attn-dp-size 2`, two DP ranks of one attention-TP
rank each, the MoE split over both. Each DP rank runs its own batch (a rank without requests runs empty IDLE
forwards for the MoE collectives), so each rank's FlashMemory state holds only its own requests, and Level 1's
lockstep and the failure exchange span one rank (the attention-TP group).

Three servers of the small-init tiny DSv4 (init_std 0.02, as in test_tp2: bf16 rounding does not flip its greedy
tokens between runs that compute the same bits): stock (the CPU layer only), FlashMemory at a full budget with
Level 1 cycling every 4 steps, FlashMemory at a three-page budget (of the requests' 5-6 pages) that faults
requests named faulty-* (on whichever DP rank runs them). The small server is launched with sglang's older spelling
of the layout (`--dp 2 --enable-dp-attention`, resolved to the same). Requests go to a chosen DP rank with sglang's
`routed_dp_rank`; each server writes one stats file per rank (`<file>` for rank 0, `<file>.rank1`).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.sglang.live.conftest import prompt, server_trio, side_by_side, small_init_model

ATTN_DP = ("--tp", "2", "--attn-dp-size", "2")
ATTN_DP_OLD = ("--tp", "2", "--dp", "2", "--enable-dp-attention")
PLAN = ("level1_cycles", "recall_pages", "warm_start_pages")


def body(ids: list[int], new: int, dp_rank: int, rid: str | None = None) -> dict:
    """A greedy /generate request for DP rank `dp_rank`."""
    b = {
        "input_ids": ids,
        "routed_dp_rank": dp_rank,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    if rid is not None:
        b["rid"] = rid
    return b


def ranks(stats: Path) -> tuple[dict, dict]:
    """The stats files of DP rank 0 and 1 (global ranks 0 and 1: one attention-TP rank per DP rank)."""
    time.sleep(1.0)  # both ranks wrote their last decode step's stats
    return tuple(json.loads(p.read_text()) for p in (stats, Path(f"{stats}.rank1")))


def series(srv, name: str) -> dict[str, float]:
    """DP rank -> the value of FlashMemory metric `name` on the server's /metrics (each DP rank's one scheduler,
    attention-TP rank 0)."""
    out = {}
    for line in srv.get_text("/metrics").splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if labels.get("attn_tp_rank") == "0":
                out[labels["dp_rank"]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def dp(tmp_path_factory, live_logs, tiny_retriever_ckpt):
    model = small_init_model(tmp_path_factory, "dp")
    stats = tmp_path_factory.mktemp("dp_stats")
    ckpt = {"SGLANG_RETRIEVER_INLINE_CKPT": tiny_retriever_ckpt}
    full = {**ckpt, "FLASHMEMORY_STATS_FILE": str(stats / "full.json")}
    small = {
        **ckpt,
        "FLASHMEMORY_FAULT_INJECT": "hook=before_forward,rid=^faulty-",
        "FLASHMEMORY_STATS_FILE": str(stats / "small.json"),
    }
    with server_trio(model, live_logs, "dp", ATTN_DP, full, small, small_layout=ATTN_DP_OLD) as servers:
        yield {**servers, "stats": stats}


def test_full_budget_equals_stock_dp_on_both_ranks(dp):
    """Two concurrent requests, one per DP rank, on stock and on FlashMemory at once: the same greedy tokens, and
    Level 1 cycled on each rank."""
    reqs = [body(prompt(300, 5), 12, 0), body(prompt(700, 6), 12, 1)]
    calls = [lambda s=s, b=b: dp[s].post("/generate", b) for s in ("stock", "full") for b in reqs]
    ref0, ref1, got0, got1 = side_by_side(*calls)
    assert [got0["output_ids"], got1["output_ids"]] == [ref0["output_ids"], ref1["output_ids"]]
    r0, r1 = ranks(dp["stats"] / "full.json")
    assert r0["level1_cycles"] > 0 and r1["level1_cycles"] > 0, (r0, r1)
    cycles = series(dp["full"], "flashmemory_level1_cycles_total")  # one series per DP rank, each its own count
    assert set(cycles) == {"0", "1"} and min(cycles.values()) > 0, cycles


def test_one_request_leaves_the_other_dp_rank_idle(dp):
    """The small server's first request, on DP rank 0: rank 0 decodes and cycles, rank 1 runs only IDLE forwards,
    which reach no FlashMemory decode step (no decode forward counted, no cycle, no page recalled)."""
    out = dp["small"].post("/generate", body(prompt(1100, 11), 12, 0))
    assert len(out["output_ids"]) == 12
    r0, r1 = ranks(dp["stats"] / "small.json")
    assert r0["decode_forwards"] > 0 and r0["level1_cycles"] > 0 and r0["warm_start_pages"] > 0
    assert r1["decode_forwards"] == 0 and {k: r1[k] for k in PLAN} == dict.fromkeys(PLAN, 0), r1
    cycles, recalled = (series(dp["small"], f"flashmemory_{k}_total") for k in ("level1_cycles", "recall_pages"))
    assert cycles["0"] > 0 and cycles["1"] == recalled["1"] == 0, (cycles, recalled)


def test_small_budget_serves_both_dp_ranks_with_level1_cycling_on_each(dp):
    """Two requests on each DP rank at once, at a three-page budget (of their 5-6 pages): each completes, and on
    each rank Level-1 cycles recalled pages beyond the warm start with part of the history resident. Both ranks get
    the same two prompts (each rank's state holds its own copies): with one request a rank's picks may never move."""
    stats = dp["stats"] / "small.json"
    b0, _ = ranks(stats)
    ids = [prompt(1300, 12), prompt(1200, 14)]
    outs = side_by_side(*(lambda r=r: dp["small"].post("/generate", body(ids, 20, r)) for r in (0, 1)))
    assert [len(r["output_ids"]) for r in outs[0] + outs[1]] == [20] * 4
    r0, r1 = ranks(stats)
    for r, base in ((r0, b0), (r1, dict.fromkeys(PLAN, 0))):
        d = {k: r[k] - base[k] for k in PLAN}
        assert d["level1_cycles"] > 0 and d["recall_pages"] > d["warm_start_pages"] > 0, (r, base)
        assert 0 < r["resident_fraction"] < 1, r  # a real budget, not all


def test_a_fault_on_one_dp_rank_fails_only_its_request(dp):
    """faulty-1 on DP rank 1 and a plain request on DP rank 0, at once: the first fails with the hook named, the
    second completes; rank 1 goes on serving. No failure is exchanged between DP ranks (each is its own batch)."""
    from flashmemory.serve.cpu_server import ServerError

    srv = dp["small"]

    def faulty() -> str:
        with pytest.raises(ServerError, match="HTTP 500") as err:
            srv.post("/generate", body(prompt(200, 23), 8, 1, rid="faulty-1"), timeout_s=300)
        return str(err.value)

    err, ok = side_by_side(faulty, lambda: srv.post("/generate", body(prompt(200, 24), 8, 0), timeout_s=300))
    assert "before_forward" in err
    assert len(ok["output_ids"]) == 8
    after = srv.post("/generate", body(prompt(200, 25), 6, 1), timeout_s=300)
    assert len(after["output_ids"]) == 6
    log = srv.log.read_text(errors="replace")
    assert "faulty-1 failed in before_forward (fault injected" in log
    assert "(on TP rank" not in log  # rank 0 never learned of it: nothing to abort there
