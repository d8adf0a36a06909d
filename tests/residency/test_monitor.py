"""Miss monitor: miss mass against a brute-force computation over the full native top-k; the monitor inside Level 1.

Level 1 is driven as serving drives it: the row is admitted with its tail page open and warm-started, and every
`on_step` follows a decode forward, so each reading is against a set decode attended (never the empty set a bare
`admit` leaves, which would read 1.0 by construction)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, check_invariants
from flashmemory.residency.escalation import EscalationConfig, EscalationController
from flashmemory.residency.level1 import Level1, Level1Config, warm_start
from flashmemory.residency.monitor import miss_mass, miss_report, resident_mask, rotate_layer, topk_softmax
from flashmemory.residency.monitored import MissMonitor, merge_selection
from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy
from flashmemory.retriever.fp8 import quantize_chunks

torch.set_num_threads(1)


def brute_miss(logits: list[float], resident: list[bool], k: int) -> tuple[float, dict[int, float], set[int], int]:
    """Plain Python: the k largest finite logits, their softmax, the mass on non-resident chunks (and per page of 4)."""
    finite = sorted(((v, j) for j, v in enumerate(logits) if v != -math.inf), reverse=True)[:k]
    if not finite:
        return 0.0, {}, set(), 4
    top = finite[0][0]
    z = sum(math.exp(v - top) for v, _ in finite)
    miss, per_page, pages = 0.0, {}, set()
    for v, j in finite:
        p = math.exp(v - top) / z
        pages.add(j // 4)
        if not resident[j]:
            miss += p
            per_page[j // 4] = per_page.get(j // 4, 0.0) + p
    return miss, per_page, pages, 4


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    n=st.integers(1, 60),
    k=st.integers(1, 70),
    n_valid=st.integers(0, 60),
    seed=st.integers(0, 10**6),
    frac=st.floats(0, 1),
)
def test_miss_mass_equals_brute_force(n, k, n_valid, seed, frac):
    g = torch.Generator().manual_seed(seed)
    # distinct values: the top-k set is unambiguous, so brute force and torch.topk pick the same chunks
    logits = (torch.randperm(n, generator=g).float() * 0.37 + torch.rand(n, generator=g) * 0.01) - 5
    logits[min(n_valid, n) :] = -math.inf
    resident = torch.rand(n, generator=g) < frac
    want, per_page, pages, _ = brute_miss(logits.tolist(), resident.tolist(), k)
    got = float(miss_mass(logits.unsqueeze(0), resident.unsqueeze(0), k)[0])
    assert got == pytest.approx(want, abs=1e-5)
    rep = miss_report(logits, resident, k, page_chunks=4, layer=7)
    assert rep.miss_mass == pytest.approx(want, abs=1e-5) and rep.layer == 7
    assert dict(zip(rep.missing_pages.tolist(), rep.missing_mass.tolist())) == pytest.approx(per_page, abs=1e-5)
    assert rep.missing_mass.tolist() == sorted(rep.missing_mass.tolist(), reverse=True)
    assert set(rep.topk_pages.tolist()) == pages


def test_batched_rows_and_edges():
    logits = torch.tensor([[0.0, 1.0, 2.0, -math.inf], [-math.inf] * 4])
    resident = torch.tensor([[True, True, False, False], [False] * 4])
    out = miss_mass(logits, resident, 2)
    e = math.exp(1.0)
    assert out[0].item() == pytest.approx(e / (1 + e)) and out[1].item() == 0.0
    idx, prob = topk_softmax(logits, 8)
    assert idx.shape == (2, 4) and float(prob[1].sum()) == 0.0
    with pytest.raises(ValueError, match="resident"):
        miss_mass(logits, resident[:, :3], 2)
    assert [rotate_layer((10, 12, 20), c) for c in range(4)] == [10, 12, 20, 10]


def test_merge_selection_budget_and_order():
    pages, prio = merge_selection([0, 3, 5], [0.9, 0.1, math.inf], [3, 7], [1e9 + 0.2, 1e9 + 0.5], budget=3)
    assert pages == [3, 5, 7] and prio[1] == math.inf
    assert merge_selection([1, 2], [0.5, 0.5], [], [], budget=1)[0] == [2]  # tie: the newer page


LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(0, 1))


def _engine(kmax: int = 0):
    """An engine with one 40-chunk (10-page) row; kmax > 0 admits it as serving does (tail page open, newest
    kmax pages warm-started)."""
    eng = OffloadEngine(
        LAYOUT, EngineConfig(max_rows=2, max_chunks=64, recall_blocks=16, decode_pages=1, max_resident_pages=8)
    )
    n = 40
    kv = torch.randint(0, 256, (3, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8)
    ix = torch.stack([quantize_chunks(torch.randn(n, LAYOUT.index_head_dim)) for _ in range(3)])
    gen = eng.admit(0, kv, ix)
    if kmax:
        eng.open_tail_page(0)
        warm_start(eng, 0, kmax)
    return eng, gen


def test_native_on_the_attended_tail_reads_no_miss_and_keeps_the_budget():
    """Native attention on the newest page, which serving's admission holds: every reading is 0, nothing widens."""
    eng, gen = _engine(kmax=2)

    def native(row, layer, n, hidden, pos):
        x = torch.full((n,), -5.0)
        x[n - 4 :] = 5.0
        return x

    ctl = EscalationController(
        EscalationConfig(
            threshold=0.2,
            low_threshold=0.05,
            base=2,
            cap=6,
            step=2,
            shrink_after=1,
            fallback_after=2,
            extra_pool=3,
            topk=4,
        )
    )
    l1 = Level1(
        eng,
        lambda r, n, h, p: torch.zeros(n),
        lambda s, n, b: torch.arange(-(-n // 4) - b, -(-n // 4)),
        Level1Config(tau=1, max_resident_pages=2, last_keep=4, async_recall=False),
        monitor=MissMonitor(eng, native, ctl, layers=(0, 1)),
    )
    hid, pos = {0: torch.zeros(1, 8), 1: torch.zeros(1, 8)}, torch.zeros(1, dtype=torch.long)
    for _ in range(3):
        l1.on_step([0], hid, pos)
    m = eng.metrics()
    req = m["requests"][eng.rows[0].rid]
    assert req["monitor_cycles"] == 3 and m["total"]["miss_mass"]["sum"] == 0.0
    assert req["escalations"] == 0 and req["fallbacks"] == 0 and req["budget_pages"] == 2 and ctl.granted == 0


def test_monitor_in_level1_adds_missing_pages_widens_then_falls_back():
    eng, gen = _engine(kmax=2)
    assert resident_mask(eng, 0, 40)[32:].all(), "the first reading is against the warm-started set, not nothing"
    wanted = 2  # native attention sits on page 2 (chunks 8..11), which the recency policy never picks

    def native(row, layer, n, hidden, pos):
        x = torch.full((n,), -5.0)
        x[8:12] = 5.0
        return x

    ctl = EscalationController(
        EscalationConfig(
            threshold=0.2,
            low_threshold=0.05,
            base=2,
            cap=6,
            step=2,
            shrink_after=1,
            fallback_after=2,
            extra_pool=3,
            topk=4,
        ),
        free_blocks=lambda: len(eng.blocks),
    )
    mon = MissMonitor(eng, native, ctl, layers=(0, 1))
    recency = lambda scores, n, budget: torch.arange(max(0, -(-n // 4) - budget), -(-n // 4))  # noqa: E731
    l1 = Level1(
        eng,
        lambda r, n, h, p: torch.zeros(n),
        recency,
        Level1Config(tau=1, max_resident_pages=2, last_keep=4, async_recall=False),
        monitor=mon,
    )
    hid, pos = {0: torch.zeros(1, 8), 1: torch.zeros(1, 8)}, torch.zeros(1, dtype=torch.long)
    l1.on_step([0], hid, pos)
    m = eng.metrics()
    req = m["requests"][eng.rows[0].rid]
    assert req["escalations"] == 1 and req["missing_pages_added"] == 1 and req["budget_pages"] == 4
    assert wanted in eng.rows[0].recall, "the page the monitor saw missing is recalled in the same cycle"
    assert m["total"]["miss_mass"]["n"] == 1 and m["total"]["miss_mass"]["counts"][-1] == 1  # page 2: all missed
    # Now the page is resident: the next cycle measures ~no miss, shrinks back one step (shrink_after=1).
    l1.on_step([0], hid, pos)
    req = eng.metrics()["requests"][eng.rows[0].rid]
    assert req["monitor_cycles"] == 2 and req["shrinks"] == 1 and req["budget_pages"] == 2 and ctl.granted == 0
    assert not check_invariants(eng)
    eng.finish(0)
    l1.on_step([-1], hid, pos)
    assert ctl.granted == 0 and ctl.snapshot() == {}


def test_fallback_holds_native_topk_and_pool_limits_widening():
    eng, gen = _engine(kmax=1)
    calls = []

    def native(row, layer, n, hidden, pos):  # attention spread over every page: misses stay high
        calls.append(layer)
        return torch.linspace(0, 1, n)

    ctl = EscalationController(
        EscalationConfig(
            threshold=0.2, low_threshold=0.05, base=1, cap=8, step=4, fallback_after=2, extra_pool=3, topk=40
        )
    )
    mon = MissMonitor(eng, native, ctl, layers=(0, 1))
    l1 = Level1(
        eng,
        lambda r, n, h, p: torch.zeros(n),
        lambda s, n, b: torch.arange(-(-n // 4) - 1, -(-n // 4)),
        Level1Config(tau=1, max_resident_pages=1, last_keep=4, async_recall=False),
        monitor=mon,
    )
    hid, pos = {0: torch.zeros(1, 8), 1: torch.zeros(1, 8)}, torch.zeros(1, dtype=torch.long)
    for _ in range(3):
        l1.on_step([0], hid, pos)
    req = eng.metrics()["requests"][eng.rows[0].rid]
    assert calls == [0, 1, 0], "the monitored layer rotates between cycles"
    assert req["fallbacks"] == 1 and req["fallback_cycles"] == 2 and req["fallback"] == 1
    assert req["budget_pages"] == 4 and ctl.granted == 3, "widening stops at the shared pool"
    assert req["escalations_denied"] >= 1
    assert len(eng.rows[0].recall) <= 4 and not check_invariants(eng)


def test_monitor_rejects_non_target_layer():
    eng, _ = _engine()
    with pytest.raises(ValueError, match="not target layers"):
        MissMonitor(eng, lambda *a: None, EscalationController(EscalationConfig(base=1, cap=2)), layers=(2,))


def test_threshold_policy_takes_the_widened_budget():
    sel = SelectionConfig(threshold=0.0, last_keep=0, kmax=8, page_chunks=4)
    pages = ThresholdPagePolicy(sel)(torch.ones(40), 40, 6)
    assert pages.numel() == 6


def test_keys_native_scorer_scores_the_device_target_keys():
    from flashmemory.residency.monitor import keys_native_scorer
    from flashmemory.retriever.fp8 import dequantize_chunks

    eng, _ = _engine()
    g = torch.Generator().manual_seed(5)
    q, w = torch.randn(3, LAYOUT.index_head_dim, generator=g), torch.randn(3, generator=g)
    score = keys_native_scorer(eng, lambda row, layer, hidden, pos: (q, w) if layer == 1 else None)
    got = score(0, 1, 40, {}, torch.tensor(0))
    keys = dequantize_chunks(eng.target.chunks(1, torch.arange(40)))  # row 0 owns mirror pages 0.. in order
    want = torch.stack([sum(torch.relu(q[h] @ keys[j]) * w[h] for h in range(3)) for j in range(40)])
    assert torch.allclose(got, want, atol=1e-4) and score(0, 0, 40, {}, torch.tensor(0)) is None
