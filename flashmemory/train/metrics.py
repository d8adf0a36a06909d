"""Retrieval metrics over scored rows: thresholded P/R/F1, recall@K, rank-based ROC-AUC, resident share.

A row is one decode step t of one doc: scores [n] over its n existing chunks and a golden mask [n]
(the lookahead window union). P/R/F1 are micro-averaged (tp/fp/fn summed over rows); recall@K and
AUC are averaged over rows that have positives (AUC: and negatives); the resident fraction is the
mean share of a row's chunks scoring above the threshold.

recall@K at tiny scale: K in {128, 256, 512, 1024} is meant for docs of ~10^4-10^5 chunks. With
`k_scale` < 1 each K becomes K_eff = max(1, round(K * k_scale)); every K_eff is then clipped to the
row's chunk count n. `auto_k_scale` picks k_scale = min(1, n_max / 8192), i.e. K keeps the same
share of a doc of n_max chunks as it has of an 8192-chunk (32K-token) doc, the short end of
upstream's data; full-size data keeps K unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

K_LIST = (128, 256, 512, 1024)
REF_CHUNKS = 8192


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Rank-based (Mann-Whitney) ROC-AUC with ties counted half. scores [n] float, labels [n] bool.
    Returns nan when a class is empty."""
    labels = labels.bool()
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    s = scores.double()
    order = torch.argsort(s)
    sorted_s = s[order]
    _, inv, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last item
    avg_rank = ends - (counts.double() - 1) / 2  # average 1-based rank inside the group
    ranks = torch.empty_like(s)
    ranks[order] = avg_rank[inv]
    u = float(ranks[labels].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def recall_at_k(scores: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Share of positives among the top-min(k, n) scores (ties broken by index). nan without positives."""
    n_pos = int(labels.sum())
    if n_pos == 0:
        return float("nan")
    k = min(k, scores.numel())
    top = torch.topk(scores, k, sorted=False).indices if k else scores.new_zeros(0, dtype=torch.long)
    return float(labels[top].sum()) / n_pos


def auto_k_scale(n_max: int) -> float:
    return min(1.0, max(n_max, 1) / REF_CHUNKS)


def effective_k(k: int, k_scale: float) -> int:
    return max(1, round(k * k_scale))


@dataclass
class RowMetrics:
    """Accumulates rows for one scorer (a layer or an ensemble)."""

    threshold: float = 0.5
    ks: tuple[int, ...] = K_LIST
    k_scale: float = 1.0
    tp: int = 0
    fp: int = 0
    fn: int = 0
    rows: int = 0
    resident: float = 0.0
    auc_sum: float = 0.0
    auc_rows: int = 0
    rk_sum: dict[int, float] = field(default_factory=dict)
    rk_rows: int = 0

    def add(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        """scores [n] (sigmoid), labels [n] bool, for one row of n existing chunks (n >= 1)."""
        if scores.numel() == 0:
            return
        labels = labels.bool()
        sel = scores > self.threshold
        self.tp += int((sel & labels).sum())
        self.fp += int((sel & ~labels).sum())
        self.fn += int((~sel & labels).sum())
        self.rows += 1
        self.resident += int(sel.sum()) / sel.numel()
        if labels.any():
            self.rk_rows += 1
            for k in self.ks:
                self.rk_sum[k] = self.rk_sum.get(k, 0.0) + recall_at_k(scores, labels, effective_k(k, self.k_scale))
            if not labels.all():
                self.auc_sum += roc_auc(scores, labels)
                self.auc_rows += 1

    def result(self) -> dict[str, float]:
        p = self.tp / max(self.tp + self.fp, 1)
        r = self.tp / max(self.tp + self.fn, 1)
        out = {
            "precision": p,
            "recall": r,
            "f1": 2 * p * r / max(p + r, 1e-12),
            "auc": self.auc_sum / self.auc_rows if self.auc_rows else float("nan"),
            "resident_frac": self.resident / max(self.rows, 1),
            "rows": self.rows,
        }
        for k in self.ks:
            out[f"r@{k}"] = self.rk_sum.get(k, 0.0) / self.rk_rows if self.rk_rows else float("nan")
        return out
