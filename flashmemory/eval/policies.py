"""Residency policies as pure functions: (doc, t, budget) -> resident mask [n_t] bool.

n_t = doc.n_chunks_at[t] (the chunks that exist at decode step t); `budget` is a chunk count
(None = the policy's own size). Every policy returns a fresh bool tensor of length n_t; chunks
created after t are not in it (at serving time the recency tail holds them).

  recency      newest `budget` chunks
  random       `budget` chunks uniformly at random (seeded by (seed, doc, t))
  oracle       the golden set itself: the lookahead window union at t (top `budget` by votes)
  reactive     the current step's native selection with no lookahead (HiSparse-like): the golden
               labels of step t alone, by votes (the dump's per-step nucleus over native logits)
  flashmemory  the retriever's ensemble scores: > threshold, or the top `budget`
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashmemory.labels import lookahead_union

Policy = Callable[[object, int, "int | None"], torch.Tensor]


def n_at(doc, t: int) -> int:
    return min(int(doc.n_chunks_at[t]), doc.n_chunks)


def top_budget(scores: torch.Tensor, budget: int | None) -> torch.Tensor:
    """Mask of the `budget` highest scores (ties to the newer chunk); all positive scores when None."""
    n = scores.numel()
    if budget is None:
        return scores > 0
    k = max(0, min(int(budget), n))
    mask = torch.zeros(n, dtype=torch.bool)
    if k:
        tie = torch.arange(n, dtype=torch.float64) / (n + 1)  # later chunk wins a tie
        mask[torch.topk(scores.double() + tie * 1e-9, k).indices] = True
    return mask


def recency(doc, t: int, budget: int | None) -> torch.Tensor:
    n = n_at(doc, t)
    mask = torch.zeros(n, dtype=torch.bool)
    if budget:
        mask[max(0, n - int(budget)) :] = True
    return mask


def random_policy(doc, t: int, budget: int | None, seed: int = 0) -> torch.Tensor:
    n = n_at(doc, t)
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(doc.doc_index) * 7_919 + t)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=g)[: min(int(budget or 0), n)]] = True
    return mask


def _votes(idx: torch.Tensor, votes: torch.Tensor, n: int) -> torch.Tensor:
    s = torch.zeros(n)
    s[idx.long()] = votes.float()
    return s


def oracle(doc, t: int, budget: int | None, tau: int = 64) -> torch.Tensor:
    n = n_at(doc, t)
    idx, votes = lookahead_union(doc.labels, t, tau, n)
    return top_budget(_votes(idx, votes, n), budget)


def reactive(doc, t: int, budget: int | None) -> torch.Tensor:
    n = n_at(doc, t)
    idx, votes = doc.labels.row(t)
    keep = idx.long() < n
    return top_budget(_votes(idx[keep], votes[keep], n), budget)


def flashmemory_mask(scores: torch.Tensor, budget: int | None, threshold: float = 0.5) -> torch.Tensor:
    """scores [n_t] ensemble sigmoids -> mask: strictly above threshold (budget None) or top `budget`."""
    if budget is None:
        return scores > threshold
    return top_budget(scores, budget)


def make_flashmemory(score_fn: Callable[[object, int], torch.Tensor], threshold: float = 0.5) -> Policy:
    """Wrap `score_fn(doc, t) -> scores [n_t]` (e.g. a retriever's ensemble) as a policy."""

    def policy(doc, t: int, budget: int | None) -> torch.Tensor:
        return flashmemory_mask(score_fn(doc, t), budget, threshold)

    return policy
