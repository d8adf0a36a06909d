"""Metrics against brute force."""

from __future__ import annotations

import torch

from flashmemory.train.metrics import RowMetrics, auto_k_scale, effective_k, recall_at_k, roc_auc


def test_auc_matches_pair_count_with_ties() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 5, (40,), generator=g).float()  # many ties
    y = torch.rand(40, generator=g) > 0.6
    pos, neg = s[y], s[~y]
    diff = pos.unsqueeze(1) - neg.unsqueeze(0)
    want = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    assert abs(roc_auc(s, y) - want) < 1e-12
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([False, True])) == 1.0
    assert roc_auc(s, torch.zeros(40, dtype=torch.bool)) != roc_auc(s, torch.zeros(40, dtype=torch.bool))  # nan


def test_recall_at_k_and_row_metrics() -> None:
    s = torch.tensor([0.9, 0.8, 0.1, 0.7, 0.2])
    y = torch.tensor([True, False, True, False, False])
    assert recall_at_k(s, y, 1) == 0.5 and recall_at_k(s, y, 3) == 0.5 and recall_at_k(s, y, 99) == 1.0
    m = RowMetrics(threshold=0.5, ks=(2,), k_scale=1.0)
    m.add(s, y)
    r = m.result()
    assert (r["precision"], r["recall"], r["resident_frac"]) == (1 / 3, 0.5, 0.6)
    assert r["r@2"] == 0.5 and abs(r["auc"] - 3 / 6) < 1e-12


def test_k_scaling() -> None:
    assert auto_k_scale(100000) == 1.0 and effective_k(512, 1.0) == 512
    assert effective_k(512, auto_k_scale(64)) == 4 and effective_k(128, auto_k_scale(64)) == 1
