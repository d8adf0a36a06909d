"""Golden labels from native indexer logits (upstream's `pass1_dump_training` rule), for all tokens at once.

Per decode token and CSA layer: take the top-k native logits (k = index_topk, capped at the visible
chunk count), softmax over those k values only, and keep the nucleus: the first entry always, every
entry whose cumulative probability is <= topp, and the entry that crosses topp. Across layers each
kept chunk gets one vote; a chunk is golden when it has >= min_layers votes. Rows are ordered by votes
descending, then chunk id ascending (upstream leaves ties unordered).

"Visible" means a finite logit: the native indexer masks chunks a query cannot see (j >= (pos+1)//4)
with -inf. `n_visible` may be passed instead/as well to mask columns explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashmemory.labels.csr import LabelsCSR, LabelsError


def _mask_visible(logits: torch.Tensor, n_visible: torch.Tensor | None) -> torch.Tensor:
    if n_visible is None:
        return logits
    n_visible = torch.as_tensor(n_visible, device=logits.device).long()
    if n_visible.shape != logits.shape[:1]:
        raise LabelsError(f"n_visible has shape {tuple(n_visible.shape)}, logits rows {logits.shape[0]}")
    cols = torch.arange(logits.shape[1], device=logits.device)
    return logits.masked_fill(cols.unsqueeze(0) >= n_visible.unsqueeze(1), float("-inf"))


def layer_nucleus(
    logits: torch.Tensor, topk: int, topp: float, n_visible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's per-token nucleus.

    logits: [T, N] float (any float dtype; computed in float32), -inf where a chunk is not visible.
    Returns (idx [T, k] int64 chunk ids sorted by logit descending, keep [T, k] bool), k = min(topk, N).
    A row with no visible chunk keeps nothing.
    """
    if logits.dim() != 2:
        raise LabelsError(f"layer logits must be [T, N], got {tuple(logits.shape)}")
    if not 0.0 <= topp <= 1.0:
        raise LabelsError(f"topp={topp} must lie in [0, 1]")
    if topk < 1:
        raise LabelsError(f"topk={topk} must be >= 1")
    t, n = logits.shape
    k = min(topk, n)
    if t == 0 or k == 0:
        z = torch.zeros(t, k, dtype=torch.long, device=logits.device)
        return z, z.bool()
    vals, idx = torch.topk(_mask_visible(logits.float(), n_visible), k, dim=1, largest=True, sorted=True)
    finite = torch.isfinite(vals)
    # Softmax over the (visible) top-k values only; a fully invisible row would give NaN, so guard it.
    safe = torch.where(finite, vals, torch.full_like(vals, -1e30))
    probs = torch.softmax(safe, dim=1) * finite
    csum = torch.cumsum(probs, dim=1)
    # Keep i iff the cumulative sum *before* i is <= topp: that is entry 0, every entry with csum <= topp,
    # and exactly the one entry that crosses topp (cumsum of non-negative floats never decreases).
    before = torch.cat((torch.zeros_like(csum[:, :1]), csum[:, :-1]), dim=1)
    keep = (before <= topp) & finite
    return idx, keep


def vote_labels(
    layer_idx: Sequence[torch.Tensor], layer_keep: Sequence[torch.Tensor], n_tokens: int, min_layers: int
) -> LabelsCSR:
    """Count per-token votes over layers. layer_idx[l], layer_keep[l]: [T, k_l]. Returns the golden CSR."""
    if min_layers < 1:
        raise LabelsError(f"min_layers={min_layers} must be >= 1")
    n_layers = len(layer_idx)
    rows, cols = [], []
    for idx, keep in zip(layer_idx, layer_keep):
        if idx.shape != keep.shape or idx.shape[0] != n_tokens:
            raise LabelsError(f"layer idx {tuple(idx.shape)} / keep {tuple(keep.shape)} do not match T={n_tokens}")
        r, c = keep.nonzero(as_tuple=True)
        rows.append(r)
        cols.append(idx[r, c])
    if not rows or sum(r.numel() for r in rows) == 0:
        return LabelsCSR.empty(n_tokens)
    row = torch.cat(rows).long().cpu()
    col = torch.cat(cols).long().cpu()
    width = int(col.max()) + 1
    uniq, votes = torch.unique(row * width + col, return_counts=True)
    sel = votes >= min_layers
    uniq, votes = uniq[sel], votes[sel]
    if uniq.numel() == 0:
        return LabelsCSR.empty(n_tokens)
    r, c = uniq // width, uniq % width
    order = torch.argsort(r * ((n_layers + 1) * width) + (n_layers - votes) * width + c)
    return LabelsCSR.from_entries(r[order], c[order], votes[order], n_tokens)


def golden_labels(
    layer_logits: Sequence[torch.Tensor] | torch.Tensor,
    topk: int = 512,
    topp: float = 0.6,
    min_layers: int = 3,
    n_visible: torch.Tensor | None = None,
) -> LabelsCSR:
    """Golden labels for T tokens.

    layer_logits: one [T, N] float tensor per CSA layer (or a [L, T, N] tensor); -inf = not visible.
    n_visible: optional [T] visible-chunk counts applied to every layer. Returns a LabelsCSR with
    T rows; scores are vote counts in [min_layers, L].
    """
    if isinstance(layer_logits, torch.Tensor):
        if layer_logits.dim() != 3:
            raise LabelsError(f"stacked logits must be [L, T, N], got {tuple(layer_logits.shape)}")
        layer_logits = list(layer_logits.unbind(0))
    if not layer_logits:
        raise LabelsError("no layer logits given")
    n_tokens = layer_logits[0].shape[0]
    idxs, keeps = [], []
    for li, lg in enumerate(layer_logits):
        if lg.dim() != 2 or lg.shape[0] != n_tokens:
            raise LabelsError(f"layer {li}: logits {tuple(lg.shape)}, expected [T={n_tokens}, N]")
        i, k = layer_nucleus(lg, topk, topp, n_visible)
        idxs.append(i)
        keeps.append(k)
    return vote_labels(idxs, keeps, n_tokens, min_layers)
