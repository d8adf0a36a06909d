"""Online miss monitor: how much of the native indexer's attention falls outside a request's resident set.

Once per Level-1 cycle and request, one target c4 layer's native indexer (whose index-K stays on the device in
both Path-P modes) scores the request's full history; the layer rotates between cycles. The request's *miss
mass* is the share of that layer's top-k softmax mass that lies on non-resident chunks. Cost: one native layer
every tau steps, against Level 2's 21 layers every step (`flashmemory bench monitor` measures the ratio).

Pure functions here; the per-request state that acts on the result is `flashmemory.residency.escalation`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")

# (row, c4 layer, n_hist, hidden {target layer: [hidden]}, position [] int) -> native logits fp32 [n_hist], or
# None when this layer's native query cannot be computed now (the monitor then skips the measurement)
NativeScorer = Callable[[int, int, int, Mapping[int, torch.Tensor], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MissReport:
    """One request's monitor result for one cycle.

    miss_mass     float in [0, 1]: softmax mass of the native top-k outside the resident set (0 if no valid pick)
    missing_pages int64 [M] logical pages holding non-resident top-k picks, most missed mass first
    missing_mass  fp32 [M] the missed softmax mass on each of those pages
    topk_pages    int64 [K'] every page holding a top-k pick (resident or not), ascending: the fallback's set
    layer         the c4 layer that was scored
    """

    miss_mass: float
    missing_pages: torch.Tensor
    missing_mass: torch.Tensor
    topk_pages: torch.Tensor
    layer: int


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Native top-k of logits [B, N] fp32 (-inf = not a candidate) and its softmax.

    Returns (idx int64 [B, k'], prob fp32 [B, k']), k' = min(k, N); picks with a -inf logit get probability 0
    (a row with no finite logit is all zeros). Softmax runs over the valid picks only, as the indexer's."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, N], got {tuple(logits.shape)}")
    if k < 1:
        raise ValueError(f"top-k must be >= 1, got {k}")
    kk = min(k, logits.shape[1])
    vals, idx = logits.float().topk(kk, dim=1)
    ok = vals > NEG_INF
    prob = torch.softmax(vals.masked_fill(~ok, NEG_INF), dim=1).nan_to_num(0.0)
    return idx, torch.where(ok, prob, torch.zeros_like(prob))


def miss_mass(logits: torch.Tensor, resident: torch.Tensor, k: int) -> torch.Tensor:
    """Share of the native top-k softmax mass on non-resident chunks.

    logits: fp32 [B, N] native indexer logits over each row's full history (-inf past it);
    resident: bool [B, N] (True = the chunk has a reserve cell now); k: the indexer's top-k (512 on DSv4).
    Returns fp32 [B] in [0, 1]; 0 for a row without a finite logit. Ties in top-k follow torch.topk."""
    if resident.shape != logits.shape:
        raise ValueError(f"resident {tuple(resident.shape)} must match logits {tuple(logits.shape)}")
    idx, prob = topk_softmax(logits, k)
    hit = resident.to(idx.device).gather(1, idx)
    return (prob * (~hit).float()).sum(1).clamp(0.0, 1.0)


def miss_report(logits: torch.Tensor, resident: torch.Tensor, k: int, page_chunks: int, layer: int) -> MissReport:
    """`miss_mass` of one request plus the pages behind it. logits: fp32 [N]; resident: bool [N]."""
    if logits.dim() != 1 or resident.shape != logits.shape:
        raise ValueError(
            f"miss_report takes one row: logits [N] and resident [N], got {tuple(logits.shape)}, "
            f"{tuple(resident.shape)}"
        )
    idx, prob = topk_softmax(logits.unsqueeze(0), k)
    idx, prob = idx[0].cpu(), prob[0].cpu()
    valid = prob > 0
    hit = resident.cpu()[idx]
    pages = idx // page_chunks
    miss = valid & ~hit
    n_pages = -(-logits.shape[0] // page_chunks)
    per_page = torch.zeros(max(n_pages, 1)).index_add_(0, pages[miss], prob[miss])
    order = per_page.argsort(descending=True, stable=True)
    order = order[per_page[order] > 0]
    return MissReport(
        float(prob[miss].sum().clamp(0.0, 1.0)), order, per_page[order], torch.unique(pages[valid]), layer
    )


def rotate_layer(layers: Sequence[int], cycle: int) -> int:
    """The target c4 layer the monitor scores at a request's `cycle`-th cycle (round robin)."""
    if not layers:
        raise ValueError("the monitor needs at least one target layer")
    return layers[cycle % len(layers)]


def resident_mask(engine, row: int, n_hist: int) -> torch.Tensor:
    """Bool [n_hist]: chunk j of the request in `row` has a reserve cell now (the engine's lookup table)."""
    cells = engine.cells(torch.tensor([row]), torch.arange(n_hist).unsqueeze(0))[0]
    return (cells >= 0).cpu()


def keys_native_scorer(
    engine, qw: Callable[[int, int, Mapping[int, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
) -> NativeScorer:
    """A `NativeScorer` over the engine's device-resident target index-K: sum_h relu(q_h . k) w_h.

    qw(row, layer, hidden, position) -> (q fp32 [H, D], w fp32 [H]): the native indexer's query and head
    weights of that layer (from the model; see `flashmemory.sglang.metrics.miss_monitor`), or None (then the scorer
    returns None)."""
    from flashmemory.retriever.model import relu_head_scores

    @torch.no_grad()
    def score(row: int, layer: int, n_hist: int, hidden: Mapping[int, torch.Tensor], position: torch.Tensor):
        got = qw(row, layer, hidden, position)
        if got is None:
            return None
        q, w = got
        keys = engine.target_keys(row, layer)[:n_hist]
        return relu_head_scores(q.float().unsqueeze(0), w.float().reshape(1, -1), keys.to(q.device))[0]

    return score
