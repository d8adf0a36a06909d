"""Residency methods for end-to-end replays: each is a Level-1 (scorer, policy) pair run by the real engine.

All methods share the page budget (KMAX) and the Level-1 cadence; only what they score differs:
- FlashMemory: the trained retriever over the target-layer index-K (threshold, recency tail, top pages, then
  the best-scoring other pages until KMAX: the default Level-1 policy).
- Recency: the newest KMAX pages.
- Random: the recency tail plus random other pages up to KMAX (seeded per cycle).
- Oracle: the pages where the coming window [t, t + tau) has the most golden (step, chunk) pairs (it reads
  the future), plus the recency tail.
- FlashMemory+monitor: FlashMemory plus the miss monitor, escalation and fallback, at an equal average
  budget (`flashmemory.eval.monitored`; the harness adds the monitor, the scorer and policy are FlashMemory's).
- Reactive: the pages holding most of the latest step's native top-k picks over all c4 layers, plus the
  tail, held for the window: the HiSparse-like policy without lookahead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from flashmemory.labels.csr import LabelsCSR
from flashmemory.residency.level1 import Scorer, retriever_scorer
from flashmemory.residency.policy import PagePolicy, SelectionConfig, ThresholdPagePolicy

METHODS = ("FlashMemory", "FlashMemory+monitor", "Recency", "Random", "Oracle", "Reactive")
# Run only when asked (never in a default method list), the retriever's scores under other page policies:
# FlashMemory-fill ranks every page by its summed score up to KMAX (no threshold set first, plus the recency tail);
# FlashMemory-threshold keeps only the pages with a chunk above the threshold (SelectionConfig policy
# "threshold": fewer than KMAX pages at a large budget).
EXTRA_METHODS = ("FlashMemory-fill", "FlashMemory-threshold")


@dataclass(frozen=True)
class DocView:
    """What a replay knows about one document: prompt length P, the Full run's native top-k picks
    (c4 id -> [S, k] int64, -1 invalid) and golden labels per decode step (CSR over T steps)."""

    prompt_len: int
    topk: Mapping[int, torch.Tensor]
    labels: LabelsCSR
    tau: int

    def step_of(self, position: torch.Tensor) -> int:
        """The decode step a Level-1 cycle serves: it runs on the hidden state of position P + t - 1."""
        return int(position) - self.prompt_len + 1


class RecencyPolicy:
    """The newest `budget` pages."""

    def __init__(self, page_chunks: int):
        self.page_chunks = page_chunks

    def __call__(self, scores: torch.Tensor, n_hist: int, budget_pages: int) -> torch.Tensor:
        n_pages = -(-n_hist // self.page_chunks)
        return torch.arange(max(0, n_pages - budget_pages), n_pages)


class RandomPolicy:
    """The recency-tail pages, then uniformly random other pages up to `budget` (fresh draw per cycle)."""

    def __init__(self, page_chunks: int, last_keep: int, seed: int = 0):
        self.page_chunks, self.last_keep = page_chunks, last_keep
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, scores: torch.Tensor, n_hist: int, budget_pages: int) -> torch.Tensor:
        n_pages = -(-n_hist // self.page_chunks)
        tail0 = max(0, n_hist - self.last_keep) // self.page_chunks if self.last_keep > 0 else n_pages
        tail = torch.arange(tail0, n_pages)[-budget_pages:] if budget_pages > 0 else torch.arange(0)
        room = budget_pages - tail.numel()
        others = torch.randperm(tail0, generator=self.gen)[: max(room, 0)]
        return torch.cat((others, tail)).sort().values


class MassPagePolicy:
    """Recency-tail pages, then the pages with the largest summed score, then (when fewer pages scored above
    zero than the budget allows) the newest other pages: every method fills the same KMAX pages, so a
    method that scores few pages is not also handed a smaller resident set."""

    def __init__(self, page_chunks: int, last_keep: int):
        self.page_chunks, self.last_keep = page_chunks, last_keep

    def __call__(self, scores: torch.Tensor, n_hist: int, budget_pages: int) -> torch.Tensor:
        pc = self.page_chunks
        n_pages = -(-n_hist // pc)
        mass = torch.zeros(n_pages * pc, dtype=torch.float64)
        mass[:n_hist] = scores[:n_hist].double().clamp_min(0.0)
        mass = mass.view(n_pages, pc).sum(1)
        tail0 = max(0, n_hist - self.last_keep) // pc if self.last_keep > 0 else n_pages
        mass[tail0:] = float("inf")
        # ties (zero-mass pages above all) go to the newer page: a recency bonus far below any count
        mass += torch.arange(n_pages, dtype=torch.float64) / (n_pages * 1e6)
        k = min(max(budget_pages, 0), n_pages)
        return mass.topk(k).indices.sort().values


def _counts(n_hist: int, chunks: torch.Tensor) -> torch.Tensor:
    c = chunks[(chunks >= 0) & (chunks < n_hist)].long()
    return torch.zeros(n_hist).index_add_(0, c, torch.ones(c.numel()))


def oracle_scorer(view: DocView) -> Scorer:
    """Per chunk: how many steps of the coming window have it golden."""

    def score(row: int, n_hist: int, hidden, position: torch.Tensor) -> torch.Tensor:
        t = min(max(view.step_of(position), 0), view.labels.n_tokens - 1)
        a = int(view.labels.pointers[t])
        b = int(view.labels.pointers[min(t + view.tau, view.labels.n_tokens)])
        return _counts(n_hist, view.labels.indices[a:b])

    return score


def reactive_scorer(view: DocView) -> Scorer:
    """Per chunk: how many c4 layers picked it at the latest step."""

    def score(row: int, n_hist: int, hidden, position: torch.Tensor) -> torch.Tensor:
        return _counts(n_hist, torch.cat([tk[int(position)] for tk in view.topk.values()]))

    return score


def zero_scorer(row: int, n_hist: int, hidden, position: torch.Tensor) -> torch.Tensor:
    return torch.zeros(n_hist)


def make_method(
    name: str, view: DocView, sel: SelectionConfig, engine, retriever=None, seed: int = 0
) -> tuple[Scorer, PagePolicy]:
    """(scorer, policy) of a method for one document on `engine` (an `OffloadEngine`)."""
    threshold = ThresholdPagePolicy(sel)
    makers: dict[str, Callable[[], tuple[Scorer, PagePolicy]]] = {
        "FlashMemory": lambda: (retriever_scorer(retriever, engine, sel.ensemble), threshold),
        "FlashMemory+monitor": lambda: (retriever_scorer(retriever, engine, sel.ensemble), threshold),
        "FlashMemory-threshold": lambda: (
            retriever_scorer(retriever, engine, sel.ensemble),
            ThresholdPagePolicy(replace(sel, policy="threshold")),
        ),
        "FlashMemory-fill": lambda: (
            retriever_scorer(retriever, engine, sel.ensemble),
            MassPagePolicy(sel.page_chunks, sel.last_keep),
        ),
        "Recency": lambda: (zero_scorer, RecencyPolicy(sel.page_chunks)),
        "Random": lambda: (zero_scorer, RandomPolicy(sel.page_chunks, sel.last_keep, seed)),
        "Oracle": lambda: (oracle_scorer(view), MassPagePolicy(sel.page_chunks, sel.last_keep)),
        "Reactive": lambda: (reactive_scorer(view), MassPagePolicy(sel.page_chunks, sel.last_keep)),
    }
    if name not in makers:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS + EXTRA_METHODS)}")
    if name.startswith("FlashMemory") and retriever is None:
        raise ValueError("the FlashMemory method needs a trained retriever")
    return makers[name]()
