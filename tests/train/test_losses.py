"""Losses against direct formulas, and the per-row averaging that makes DDP exact."""

from __future__ import annotations

import math

import torch

from flashmemory.train.losses import bce_loss, bpr_loss, focal_loss


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 5, generator=g)
    t = (torch.rand(3, 5, generator=g) > 0.5).float()
    w = torch.rand(3, 5, generator=g) + 0.5
    m = torch.ones(3, 5, dtype=torch.bool)
    m[1, 3:] = False
    return z, t, w, m


def test_focal_matches_formula() -> None:
    z, t, w, m = _batch()
    rows = []
    for r in range(3):
        vals = []
        for c in range(5):
            if not m[r, c]:
                continue
            p = 1 / (1 + math.exp(-float(z[r, c])))
            pt = p if t[r, c] > 0 else 1 - p
            vals.append(-math.log(pt) * (1 - pt) ** 2 * float(w[r, c]))
        rows.append(sum(vals) / len(vals))
    assert abs(float(focal_loss(z, t, w, m)) - sum(rows) / 3) < 1e-6


def test_padding_is_ignored_and_rows_average() -> None:
    z, t, w, m = _batch()
    z2 = z.clone()
    z2[~m] = 1e4  # garbage in padded slots
    assert torch.allclose(bce_loss(z, t, w, m), bce_loss(z2, t, w, m))
    whole = bce_loss(z, t, w, m)
    halves = (bce_loss(z[:1], t[:1], w[:1], m[:1]) + 2 * bce_loss(z[1:], t[1:], w[1:], m[1:])) / 3
    assert torch.allclose(whole, halves)


def test_bpr() -> None:
    z = torch.tensor([[2.0, 0.0, 1.0]])
    t = torch.tensor([[1.0, 0.0, 0.0]])
    m = torch.ones(1, 3, dtype=torch.bool)
    want = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(-1.0))) / 2
    assert abs(float(bpr_loss(z, t, m)) - want) < 1e-6
    assert float(bpr_loss(z, torch.ones(1, 3), m)) == 0.0  # no negatives: no pairs
