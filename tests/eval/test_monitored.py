"""FlashMemory+monitor in the replay: readings only against a set a decode step attended, the missed page
recovered, and the budget matched on average.

The replay admits a row with nothing resident and runs its step-0 cycle on the prompt's last position, before
any decode step. A reading there compares the native top-k with an empty set: 1.0 by construction.
`test_native_on_the_newest_chunks_reads_no_miss` and `test_every_reading_is_one_minus_the_attended_mass` catch
that reading; the rest pin the monitor's effect once it reads what decode attended.
"""

import math

import pytest
import torch

from flashmemory.eval.methods import RandomPolicy, RecencyPolicy, zero_scorer
from flashmemory.eval.monitored import (
    MonitorEvalConfig,
    captured_native_scorer,
    equal_budget_replay,
    mean_resident_pages,
    monitor_factory,
)
from flashmemory.eval.replay import replay_doc
from flashmemory.retriever.fp8 import quantize_chunks

P, T, PC, TAU = 128, 32, 4, 8


def _visible(S: int, n: int) -> torch.Tensor:
    """bool [S, n]: chunk j is visible to the query at position q (j < (q + 1) // 4)."""
    return torch.arange(n).unsqueeze(0) < ((torch.arange(S) + 1) // 4).unsqueeze(1)


def _doc(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = (P + T) // 4
    chunks = torch.stack([quantize_chunks(torch.randn(n, 8, generator=g)) for _ in range(3)])
    hid = {l: torch.randn(P + T, 16, generator=g) for l in range(3)}
    return chunks, hid, n


def _far_doc():
    """Native attention of every query sits on chunks 4..7 (page 1), far from the recency tail."""
    chunks, hid, n = _doc()
    logits = torch.full((P + T, n), -4.0)
    logits[:, 4:8] = 4.0
    vis = _visible(P + T, n)
    return chunks, hid, {1: logits.masked_fill(~vis, -math.inf), 2: logits.masked_fill(~vis, -math.inf)}, n


def _replay(chunks, hid, kmax, monitor=None, cap=None, policy=None, tau=TAU, last_keep=4):
    return replay_doc(
        chunks,
        hid,
        P,
        T,
        lambda e: (zero_scorer, policy or RecencyPolicy(PC)),
        page_chunks=PC,
        kmax=kmax,
        tau=tau,
        last_keep=last_keep,
        target_layers=(1, 2),
        monitor=monitor,
        page_cap=cap,
    )


def test_native_on_the_newest_chunks_reads_no_miss():
    """Native attention only on each query's newest 4 chunks, which the recency tail and the decode region
    always hold: every reading is ~0 and nothing escalates (the forced first-cycle reading was 1.0 and escalated)."""
    chunks, hid, n = _doc(1)
    vis = _visible(P + T, n)
    newest = vis & (torch.arange(n).unsqueeze(0) >= ((torch.arange(P + T) + 1) // 4 - 4).unsqueeze(1))
    logits = torch.where(newest, 4.0, -4.0).masked_fill(~vis, -math.inf)
    mon = _replay(
        chunks, hid, 3, monitor_factory({1: logits, 2: logits}, (1, 2), 3, 6, topk=4, mc=MonitorEvalConfig()), cap=6
    )
    m = mon.metrics
    assert len(m["miss_values"]) == T // TAU - 1, "one reading per cycle after the first decode step"
    assert max(m["miss_values"]) < 0.05, m["miss_values"]
    assert m["escalations"] == 0 and m["fallbacks"] == 0 and m["missing_pages_added"] == 0


def _topk_mass(logits: torch.Tensor, resident: torch.Tensor, k: int) -> float:
    """Plain-Python softmax mass of the k largest finite logits that lies on resident chunks (1-D inputs)."""
    finite = sorted(((float(v), j) for j, v in enumerate(logits.tolist()) if v != -math.inf), reverse=True)[:k]
    if not finite:
        return 1.0
    z = sum(math.exp(v - finite[0][0]) for v, _ in finite)
    return sum(math.exp(v - finite[0][0]) / z for v, j in finite if resident[j])


@pytest.mark.parametrize("seed", range(6))
def test_every_reading_is_one_minus_the_attended_mass(seed):
    """Random documents, policies and budgets: the k-th reading comes from the cycle at step t = (k + 1) tau and
    equals 1 - the rotated layer's native top-k mass at the query of step t - 1 over the set step t - 1 attended."""
    g = torch.Generator().manual_seed(100 + seed)
    chunks, hid, n = _doc(seed)
    tau = int(torch.randint(3, 9, (1,), generator=g))
    kmax, topk = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 12, (1,), generator=g))
    vis = _visible(P + T, n)
    # distinct logits (no top-k ties), a random few chunks favoured
    logits = {
        l: (torch.randn(P + T, n, generator=g) + 6.0 * (torch.rand(n, generator=g) < 0.15)).masked_fill(~vis, -math.inf)
        for l in (1, 2)
    }
    rep = _replay(
        chunks,
        hid,
        kmax,
        monitor_factory(logits, (1, 2), kmax, 2 * kmax, topk, MonitorEvalConfig()),
        cap=2 * kmax,
        policy=RandomPolicy(PC, 4, seed),
        tau=tau,
    )
    due = [t for t in range(tau, T, tau)]
    got = rep.metrics["miss_values"]
    assert len(got) == len(due), f"readings {got} against cycles at steps {due}"
    assert rep.metrics["miss_steps"] == due
    for k, (t, v) in enumerate(zip(due, got)):
        layer = (1, 2)[k % 2]
        n_prev = int(rep.n_visible[t - 1])
        want = 1.0 - _topk_mass(logits[layer][P + t - 1, :n_prev], rep.resident[t - 1, :n_prev], topk)
        assert v == pytest.approx(want, abs=1e-5), (k, t, layer)


def test_monitor_recovers_the_missed_page_and_counts():
    chunks, hid, logits, n = _far_doc()
    base = _replay(chunks, hid, 3)
    mon = _replay(chunks, hid, 3, monitor_factory(logits, (1, 2), 3, 6, topk=4, mc=MonitorEvalConfig()), cap=6)
    assert not base.resident[:, 4:8].any(), "recency alone never holds page 1"
    assert not mon.resident[:TAU, 4:8].any(), "no reading before a decode step attended a set: nothing injected"
    assert mon.resident[TAU:, 4:8].all(), "the page the monitor saw missing is recalled at its first reading"
    m = mon.metrics
    assert m["monitor_cycles"] == 3 and m["escalations"] >= 1 and m["missing_pages_added"] >= 1
    assert m["miss_values"][0] > 0.99 and m["miss_values"][-1] < 0.01
    assert m["miss_mass"]["n"] == 3 and m["miss_steps"] == [8, 16, 24]


def test_equal_budget_search_matches_the_average():
    chunks, hid, logits, n = _far_doc()
    target = mean_resident_pages(_replay(chunks, hid, 4).resident, PC)
    rep, info = equal_budget_replay(
        lambda k, mon=None, cap=None: _replay(chunks, hid, k, mon, cap),
        target,
        4,
        8,
        PC,
        lambda b, c: monitor_factory(logits, (1, 2), b, c, 4, MonitorEvalConfig()),
    )
    assert info["budget_matched"] and info["mean_pages"] <= target + 1e-9
    assert info["mean_pages"] == mean_resident_pages(rep.resident, PC) and 1 <= info["base_pages"] <= 4
    assert rep.resident[TAU:, 4:8].all(), "at the matched budget the monitored method still holds the attended page"


def test_captured_scorer_pads_clamps_and_skips_the_prompt():
    lg = torch.tensor([[1.0, 2.0, -math.inf]])
    out = captured_native_scorer({0: lg})(0, 0, 4, {}, torch.tensor(5))
    assert out.tolist()[:2] == [1.0, 2.0] and out[2:].eq(-math.inf).all()
    assert captured_native_scorer({0: lg}, first_position=6)(0, 0, 4, {}, torch.tensor(5)) is None
    assert captured_native_scorer({0: lg}, first_position=5)(0, 0, 4, {}, torch.tensor(5)) is not None


def test_residency_cli_names_bad_lengths(capsys):
    from flashmemory.cli import main

    assert main(["eval", "--residency", "--checkpoint", "none.safetensors", "--lengths", "10"]) == 2
    assert "--lengths" in capsys.readouterr().err
