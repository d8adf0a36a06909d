"""Level-1 selection: retriever scores -> resident chunks or pages.

A chunk passes when its ensemble score is strictly above the threshold. The recency tail (last
`last_keep` chunks) and the sink (first `first_keep` chunks) are always kept. Page mode scores a
64-chunk page by its number of passing chunks, forces tail and sink pages in, and keeps the best
`kmax` pages in ascending order.

Two page policies (`SelectionConfig.policy`):
  fill       (default) the threshold's pages first, then the pages no chunk of which passed, ranked by
             their summed score, until `kmax`: a larger budget always buys the retriever's next-best pages.
  threshold  only pages with a passing chunk (plus tail and sink): the resident set is what the threshold
             asked for, however large `kmax` is (fewer recall bytes, but extra budget buys nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

PAGE_POLICIES = ("fill", "threshold")  # the first is the default


@dataclass(frozen=True)
class SelectionConfig:
    threshold: float = 0.5  # keep if score > threshold (strict)
    ensemble: str = "or"  # "or" = max over layers, "mean" = average
    last_keep: int = 2048  # recency tail, chunks
    first_keep: int = 0  # sink, chunks
    max_resident: int = 0  # cap on resident chunks per request, 0 = none
    page_chunks: int = 64  # chunks per page
    kmax: int = 96  # resident pages per request
    policy: str = "fill"  # "fill": threshold pages, then the best-scoring others up to kmax; "threshold": only them

    def __post_init__(self) -> None:
        if self.policy not in PAGE_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(PAGE_POLICIES)}, got {self.policy!r}")
        if self.ensemble not in ("or", "max", "mean"):
            raise ValueError(f"ensemble must be 'or'/'max' or 'mean', got {self.ensemble!r}")
        if self.page_chunks < 1 or self.kmax < 1:
            raise ValueError("page_chunks and kmax must be >= 1")
        if min(self.last_keep, self.first_keep, self.max_resident) < 0:
            raise ValueError("last_keep, first_keep and max_resident must be >= 0")

    @property
    def page_cap(self) -> int:
        """Pages a request may hold: kmax, tightened by max_resident when that is set."""
        if self.max_resident > 0:
            return max(1, min(self.kmax, self.max_resident // self.page_chunks))
        return self.kmax


def ensemble_scores(per_layer: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], mode: str = "or") -> torch.Tensor:
    """Combine per-layer scores [B, N] into one [B, N]: max for "or"/"max", mean for "mean"."""
    xs = list(per_layer.values()) if isinstance(per_layer, Mapping) else list(per_layer)
    if not xs:
        raise ValueError("ensemble_scores needs at least one layer")
    stacked = torch.stack(xs, 0)
    if mode in ("or", "max"):
        return stacked.amax(0)
    if mode == "mean":
        return stacked.mean(0)
    raise ValueError(f"unknown ensemble mode {mode!r}")


def _valid(lengths: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def forced_mask(lengths: torch.Tensor, n: int, cfg: SelectionConfig) -> torch.Tensor:
    """Bool [B, N]: recency tail (j >= len - last_keep) and sink (j < first_keep), inside each history."""
    j = torch.arange(n, device=lengths.device).unsqueeze(0)
    ln = lengths.unsqueeze(1)
    tail = j >= ln - cfg.last_keep if cfg.last_keep > 0 else torch.zeros_like(j, dtype=torch.bool)
    sink = j < cfg.first_keep
    return (tail | sink) & (j < ln)


def select_chunks(scores: torch.Tensor, lengths: torch.Tensor, cfg: SelectionConfig) -> torch.Tensor:
    """Chunk-granular selection: Bool [B, N] of resident chunks.

    scores: [B, N] ensemble scores; lengths: [B] history length in chunks (columns past it are never kept).
    With `max_resident`, forced chunks come first, then the highest-scoring passing chunks up to the cap.
    """
    b, n = scores.shape
    valid = _valid(lengths, n)
    forced = forced_mask(lengths, n, cfg)
    passing = (scores > cfg.threshold) & valid & ~forced
    if cfg.max_resident <= 0:
        return forced | passing
    room = (cfg.max_resident - forced.sum(1)).clamp_min(0)  # [B]
    ranked = scores.masked_fill(~passing, float("-inf"))
    order = ranked.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n, device=scores.device).expand(b, n))
    return forced | (passing & (rank < room.unsqueeze(1)))


def _desc_stable(order: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Reorder `order` [B, P] by `key` (gathered along it), descending, keeping earlier order on ties."""
    k = key.gather(1, order)
    return order.gather(1, torch.sort(k, dim=1, descending=True, stable=True).indices)


def page_keys(scores: torch.Tensor, lengths: torch.Tensor, cfg: SelectionConfig) -> torch.Tensor:
    """Int64 [B, P] ranking keys per page; higher is better, -1 = not selectable.

    scores: [B, N] ensemble scores; lengths: [B] chunks of history. P = ceil(N / page_chunks).
    Forced pages (tail, sink) rank above every scored page, more recent first; then pages by their
    count of passing chunks; equal counts by the summed score of those chunks (so a threshold that
    passes everything still ranks pages by the retriever, not by position); then, with policy "fill",
    the pages without a passing chunk by their summed score (negative scores count as 0); last, the
    more recent page. Every page inside a row's history has a distinct key >= 0 under "fill"; under
    "threshold" pages without a passing chunk (and not forced) get -1. Pages past the history get -1.
    The order of the pages that have a key does not depend on the policy.
    """
    b, n = scores.shape
    pc = cfg.page_chunks
    n_pages = -(-n // pc)
    valid = _valid(lengths, n)
    passing = (scores > cfg.threshold) & valid
    pad = n_pages * pc - n
    count = torch.nn.functional.pad(passing.to(torch.int64), (0, pad)).view(b, n_pages, pc).sum(-1)
    mass = torch.nn.functional.pad(torch.where(passing, scores.double(), 0.0), (0, pad)).view(b, n_pages, pc).sum(-1)
    rest = torch.where(valid, scores.double().clamp_min(0.0), 0.0)
    rest = torch.nn.functional.pad(rest, (0, pad)).view(b, n_pages, pc).sum(-1)  # summed score, for fill
    forced = torch.nn.functional.pad(forced_mask(lengths, n, cfg), (0, pad)).view(b, n_pages, pc).any(-1)
    p = torch.arange(n_pages, device=scores.device).unsqueeze(0).expand(b, n_pages)
    # Lexicographic (forced, count, mass, rest, page) via stable sorts from the least significant key up;
    # rest only orders the pages without a passing chunk (the threshold's own order stays as it was).
    order = p.flip(1).contiguous()
    order = _desc_stable(order, rest.masked_fill(forced | (count > 0), 0.0))
    order = _desc_stable(order, mass.masked_fill(forced, 0.0))
    order = _desc_stable(order, count.masked_fill(forced, 0))
    order = _desc_stable(order, forced.to(torch.int64))
    key = torch.empty_like(p).scatter_(1, order, torch.arange(n_pages, 0, -1, device=p.device).expand(b, n_pages))
    live = p < (lengths.unsqueeze(1) + pc - 1) // pc
    keep = live & (forced | (count > 0) | (cfg.policy == "fill"))
    return torch.where(keep, key, torch.full_like(key, -1))


def select_pages(
    scores: torch.Tensor, lengths: torch.Tensor, cfg: SelectionConfig, kmax: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page-granular selection: the `kmax` best pages by `page_keys`.

    scores: [B, N] ensemble scores; lengths: [B] chunks of history.
    Returns (pages [B, K] int64, ascending, padded with -1; counts [B] int64), K = min(kmax, pages).
    Never returns a page past a row's history. With policy "fill" a row keeps min(kmax, its pages) pages;
    with "threshold" at most that many. Ties resolve the same way on every call (no randomness).
    """
    cap = kmax if kmax is not None else cfg.page_cap
    keys = page_keys(scores, lengths, cfg)
    k = min(cap, keys.shape[1])
    if k == 0:
        return keys.new_empty(keys.shape[0], 0), keys.new_zeros(keys.shape[0])
    top, idx = keys.topk(k, dim=1)
    ok = top >= 0
    pages = torch.where(ok, idx, torch.full_like(idx, torch.iinfo(torch.int64).max)).sort(dim=1).values
    pages = pages.masked_fill(pages == torch.iinfo(torch.int64).max, -1)
    return pages, ok.sum(1)


class PagePolicy(Protocol):
    """The pluggable Level-1 policy: (scores [N], history length, page budget) -> pages [K] ascending."""

    def __call__(self, scores: torch.Tensor, n_hist: int, budget_pages: int) -> torch.Tensor: ...


class ThresholdPagePolicy:
    """Level 1's page policy over `select_pages`: threshold, recency tail and sink, top pages by passing-chunk
    count, then (cfg.policy "fill", the default) the best-scoring other pages until the budget is spent."""

    def __init__(self, cfg: SelectionConfig):
        self.cfg = cfg

    def __call__(self, scores: torch.Tensor, n_hist: int, budget_pages: int) -> torch.Tensor:
        pages, count = select_pages(
            scores.unsqueeze(0),
            torch.tensor([n_hist], device=scores.device),
            self.cfg,
            kmax=min(budget_pages, self.cfg.page_cap),
        )
        return pages[0, : int(count[0])]
