"""FlashMemory+monitor in the replay: the monitor recovers a missed page, and the budget is matched on average."""

import math

import torch

from flashmemory.eval.methods import RecencyPolicy, zero_scorer
from flashmemory.eval.monitored import (MonitorEvalConfig, captured_native_scorer, equal_budget_replay,
                                        mean_resident_pages, monitor_factory)
from flashmemory.eval.replay import replay_doc
from flashmemory.retriever.fp8 import quantize_chunks

P, T, PC = 128, 32, 4


def _doc():
    n = (P + T) // 4
    chunks = torch.stack([quantize_chunks(torch.randn(n, 8)) for _ in range(3)])
    hid = {l: torch.randn(P + T, 16) for l in range(3)}
    # Native attention of every query sits on chunks 4..7 (page 1), far from the recency tail.
    logits = torch.full((P + T, n), -4.0)
    logits[:, 4:8] = 4.0
    vis = torch.arange(n).unsqueeze(0) < ((torch.arange(P + T) + 1) // 4).unsqueeze(1)
    return chunks, hid, {1: logits.masked_fill(~vis, -math.inf), 2: logits.masked_fill(~vis, -math.inf)}, n


def _replay(chunks, hid, kmax, monitor=None, cap=None):
    return replay_doc(chunks, hid, P, T, lambda e: (zero_scorer, RecencyPolicy(PC)), page_chunks=PC, kmax=kmax,
                      tau=8, last_keep=4, target_layers=(1, 2), monitor=monitor, page_cap=cap)


def test_monitor_recovers_the_missed_page_and_counts():
    chunks, hid, logits, n = _doc()
    base = _replay(chunks, hid, 3)
    mon = _replay(chunks, hid, 3, monitor_factory(logits, (1, 2), 3, 6, topk=4, mc=MonitorEvalConfig()), cap=6)
    assert not base.resident[:, 4:8].any(), "recency alone never holds page 1"
    assert mon.resident[:, 4:8].all(), "the page the monitor saw missing is recalled at the first cycle"
    m = mon.metrics
    assert m["monitor_cycles"] == 4 and m["escalations"] >= 1 and m["missing_pages_added"] >= 1
    assert m["miss_values"][0] > 0.99 and m["miss_values"][-1] < 0.01
    assert m["miss_mass"]["n"] == 4


def test_equal_budget_search_matches_the_average():
    chunks, hid, logits, n = _doc()
    target = mean_resident_pages(_replay(chunks, hid, 4).resident, PC)
    rep, info = equal_budget_replay(lambda k, mon=None, cap=None: _replay(chunks, hid, k, mon, cap), target, 4, 8,
                                    PC, lambda b, c: monitor_factory(logits, (1, 2), b, c, 4, MonitorEvalConfig()))
    assert info["budget_matched"] and info["mean_pages"] <= target + 1e-9
    assert info["mean_pages"] == mean_resident_pages(rep.resident, PC) and 1 <= info["base_pages"] <= 4
    assert rep.resident[:, 4:8].all(), "at the matched budget the monitored method still holds the attended page"


def test_captured_scorer_pads_and_clamps():
    lg = torch.tensor([[1.0, 2.0, -math.inf]])
    out = captured_native_scorer({0: lg})(0, 0, 4, {}, torch.tensor(5))
    assert out.tolist()[:2] == [1.0, 2.0] and out[2:].eq(-math.inf).all()


def test_residency_cli_names_bad_lengths(capsys):
    from flashmemory.cli import main
    assert main(["eval", "--residency", "--checkpoint", "none.safetensors", "--lengths", "10"]) == 2
    assert "--lengths" in capsys.readouterr().err
