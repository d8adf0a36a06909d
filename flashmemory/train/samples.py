"""Training samples from a golden-label dump: targets per (doc, t), positives, negatives, weights.

One sample per decode step t (every `sample_interval`) whose lookahead window [t, t + tau) holds at
least one golden label. Positives are the window union (at most `max_pos`, drawn without
replacement); negatives, `neg_ratio` times as many, are drawn uniformly from the other chunks.

Causality (a fix over upstream). At serving time the retriever runs at step t and can only score
chunks that already exist: chunk j exists once token 4j+3 has been seen, so step t has
`n_chunks_at[t] = (position_t + 1) // ratio` chunks. Upstream sampled negatives from the whole
doc's keys (prompt + the full response, including chunks created after t) and kept positives
created inside the window. Here only chunks with index < n_chunks_at[t] are ever scored, drawn as
negatives or counted as positives; a chunk created inside [t, t + tau) is dropped from the targets
because at serving time the recency tail covers it. Effect: upstream's numbers include trivially
rejectable future chunks (inflating precision and AUC) and positives that no retriever could have
scored at t (deflating recall); `causal=False` reproduces upstream for comparison (see
training/README.md for both on the micro dump).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmemory.labels import LabelsCSR, lookahead_union_all

MAX_NEG_RATIO = 1e6  # far above any useful ratio (negatives are capped by the chunks that exist anyway)


@dataclass(frozen=True)
class SampleConfig:
    label_interval: int = 64  # tau: lookahead window [t, t + tau)
    max_pos: int = 512  # positives per sample (drawn without replacement when more)
    neg_ratio: float = 1.0  # negatives per positive
    sample_interval: int = 1  # keep every k-th decode step
    weighted: bool = False  # upstream vote weights for positives
    causal: bool = True  # only chunks that exist at t (see module docstring)
    vote_lo: int = 3  # votes mapped to weight 0.5 ...
    vote_hi: int = 21  # ... and to weight 2.0 (linear between, clamped)
    frequent_frac: float = 0.8  # positives golden for more than this share of a doc's tokens ...
    frequent_weight: float = 0.5  # ... get this weight (always applied, as upstream)

    def __post_init__(self) -> None:
        for name in ("label_interval", "max_pos", "sample_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if not 0 <= self.neg_ratio <= MAX_NEG_RATIO:  # also NaN and inf, which reach int() in `draw_sample`
            raise ValueError(
                f"--neg-ratio {self.neg_ratio}: must lie in [0, {MAX_NEG_RATIO:g}] (negatives per positive)"
            )
        if self.vote_hi <= self.vote_lo:
            raise ValueError(f"vote_hi ({self.vote_hi}) must exceed vote_lo ({self.vote_lo})")


@dataclass(frozen=True)
class DocTargets:
    """Per-doc label state, small enough to keep for every doc while hidden states stay on disk.

    union: window unions as CSR with T rows (chunk ids ascending, score = max votes in the window),
      already limited to chunks < n_avail[t].
    n_avail: [T] int64 chunks that may be scored at step t (n_chunks_at in causal mode, else all N).
    frequent: [N] bool, chunks golden for more than `frequent_frac` of the doc's tokens.
    rows: [S] int64 decode steps that make a sample.
    """

    union: LabelsCSR
    n_avail: torch.Tensor
    frequent: torch.Tensor
    rows: torch.Tensor


def doc_labels(doc) -> LabelsCSR:
    return LabelsCSR(
        doc.label_indices.to(torch.int32), doc.label_scores.to(torch.int32), doc.label_pointers.to(torch.int32)
    )


def n_chunks_total(doc) -> int:
    """Rows in the dumped keys (all layers dump the same chunk count)."""
    return int(next(iter(doc.compk.values())).shape[0])


def available_chunks(doc, causal: bool = True) -> torch.Tensor:
    """[T] int64: chunks scoreable at each step (existing ones when causal, else every dumped chunk)."""
    n = n_chunks_total(doc)
    if not causal:
        return torch.full((doc.n_tokens,), n, dtype=torch.int64)
    return doc.n_chunks_at.long().clamp(max=n)


def doc_targets(doc, cfg: SampleConfig) -> DocTargets:
    labels = doc_labels(doc)
    n_avail = available_chunks(doc, cfg.causal)
    union = lookahead_union_all(labels, cfg.label_interval, n_avail)
    n = n_chunks_total(doc)
    hits = torch.bincount(labels.indices.long(), minlength=n)[:n] if labels.indices.numel() else torch.zeros(n)
    frequent = hits.float() > cfg.frequent_frac * max(doc.n_tokens, 1)
    steps = torch.arange(0, doc.n_tokens, cfg.sample_interval)
    rows = steps[union.counts[steps] > 0]
    return DocTargets(union, n_avail, frequent, rows)


def positive_weights(
    votes: torch.Tensor, chunk_ids: torch.Tensor, frequent: torch.Tensor, cfg: SampleConfig
) -> torch.Tensor:
    """[P] fp32 weights: 1, or with `weighted` 0.5 + 1.5 (v - lo) / (hi - lo) clamped to [0.5, 2];
    then chunks in `frequent` get `frequent_weight`."""
    if cfg.weighted:
        w = (0.5 + 1.5 * (votes.float() - cfg.vote_lo) / (cfg.vote_hi - cfg.vote_lo)).clamp(0.5, 2.0)
    else:
        w = torch.ones(votes.numel())
    return torch.where(frequent[chunk_ids], torch.full_like(w, cfg.frequent_weight), w)


def draw_sample(
    tg: DocTargets, t: int, cfg: SampleConfig, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunk ids [n] int64, targets [n] fp32 in {0, 1}, weights [n] fp32), positives first.

    Every id is < n_avail[t]; negatives never include any chunk of the (uncapped) window union.
    """
    pos, votes = tg.union.row(t)
    pos, votes = pos.long(), votes
    if pos.numel() > cfg.max_pos:
        keep = torch.randperm(pos.numel(), generator=gen)[: cfg.max_pos].sort().values
        pos_s, votes_s = pos[keep], votes[keep]
    else:
        pos_s, votes_s = pos, votes
    n_avail = int(tg.n_avail[t])
    is_pos = torch.zeros(n_avail, dtype=torch.bool)
    is_pos[pos] = True
    pool = (~is_pos).nonzero().squeeze(1)
    n_neg = min(int(round(cfg.neg_ratio * pos_s.numel())), pool.numel())
    neg = pool[torch.randperm(pool.numel(), generator=gen)[:n_neg]] if n_neg else pool[:0]
    ids = torch.cat((pos_s, neg))
    target = torch.cat((torch.ones(pos_s.numel()), torch.zeros(n_neg)))
    weight = torch.cat((positive_weights(votes_s, pos_s, tg.frequent, cfg), torch.ones(n_neg)))
    return ids, target, weight
