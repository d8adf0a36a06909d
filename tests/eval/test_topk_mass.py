"""Native mass from a stored native top-k equals a plain brute-force computation; fallback otherwise."""

from __future__ import annotations

import math

import torch

from flashmemory.eval.evaluate import EvalConfig, evaluate, mass_note, native_mass
from flashmemory.eval.policies import n_at, recency
from tests.dump.synth import make_doc
from tests.dump.test_topk_store import add_topk


def brute_mass(doc, t: int, mask: list[bool], tau: int, topk: int) -> list[float]:
    """Plain Python: per stored step in [t, t+tau), mean over layers of the resident softmax share."""
    out = []
    for r, s in enumerate(doc.native_topk_steps.tolist()):
        if not t <= s < t + tau:
            continue
        per_layer = []
        for C in sorted(doc.native_topk):
            picks = [
                (float(v), int(i))
                for i, v in zip(doc.native_topk[C][0][r].tolist(), doc.native_topk[C][1][r].tolist())
                if i >= 0
            ]
            picks = sorted(picks, reverse=True)[:topk]
            if not picks:
                continue
            m = max(v for v, _ in picks)
            z = sum(math.exp(v - m) for v, _ in picks)
            inside = sum(math.exp(v - m) for v, i in picks if i >= len(mask) or mask[i])
            per_layer.append(inside / z)
        if per_layer:
            out.append(sum(per_layer) / len(per_layer))
    return out


def test_stored_mass_matches_brute_force() -> None:
    doc = add_topk(make_doc(0, P=21, T=12), [0, 3, 6, 9], k=7, n_layers=3, seed=5)
    n = n_at(doc, 4)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(n, generator=g) < 0.5
    for tau, topk in ((4, 512), (8, 512), (8, 3), (1, 512)):
        got = native_mass(doc, 4, mask, tau, topk)
        want = brute_mass(doc, 4, mask.tolist(), tau, topk)
        assert len(got) == len(want) == len([s for s in (0, 3, 6, 9) if 4 <= s < 4 + tau])
        for a, b in zip(got, want):
            assert abs(a - b) < 1e-5
    assert native_mass(doc, 4, torch.zeros(n, dtype=torch.bool), 8, 512) != native_mass(doc, 4, mask, 8, 512)


def test_evaluate_uses_stored_topk_and_falls_back() -> None:
    doc = add_topk(make_doc(0, P=21, T=12), [0, 2, 4, 6, 8, 10], k=5, n_layers=4, seed=2)
    cfg = EvalConfig(tau=4, fractions=(0.5,), native_topk=512)
    scores = lambda d, t: torch.linspace(0, 1, n_at(d, t))  # noqa: E731 - a fixed, recency-like score
    res = evaluate([doc], scores, cfg)["0.5"]["recency"]
    want = []
    for t in range(0, doc.n_tokens, cfg.tau):
        k = math.ceil(0.5 * n_at(doc, t))
        want += brute_mass(doc, t, recency(doc, t, k).tolist(), cfg.tau, cfg.native_topk)
    assert res["mass_steps"] == len(want) == 6  # every cycle, not only t = 0
    assert abs(res["native_mass"] - sum(want) / len(want)) < 1e-6
    old = make_doc(1, P=21, T=12)  # no stored top-k: the first 3 steps' dumped logits only
    assert evaluate([old], scores, cfg)["0.5"]["recency"]["mass_steps"] == 3
    note = mass_note([doc, old])
    assert "mass over 6 stored steps x 4 layers" in note and "1 doc(s) without stored top-k" in note
    assert "t=0 cycle only" not in mass_note([doc]) and "mass over" in mass_note([doc])
    assert "stored steps" not in mass_note([old]) and "t=0 cycle only" in mass_note([old])
