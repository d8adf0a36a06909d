"""Retriever training losses on raw logits (sigmoid is folded in for numerical stability).

Every loss is averaged per row first (over that row's valid chunks / pairs), then summed and
divided by the batch's row count B (a row with nothing to score adds 0). Upstream took one masked
mean over all elements of the batch; this form makes the loss of a batch exactly the mean of its
equal halves' losses, so DDP's gradient average equals the single-process gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    per_row = (x * m).sum(1) / m.sum(1).clamp_min(1.0)
    return per_row.sum() / max(x.shape[0], 1)


def bce_loss(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weighted binary cross-entropy. logits/target/weight: [B, n] (fp32 math), mask: [B, n] bool -> scalar."""
    z = logits.float().masked_fill(~mask, 0.0)
    return _row_mean(F.binary_cross_entropy_with_logits(z, target, reduction="none") * weight, mask)


def focal_loss(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor, gamma: float = 2.0
) -> torch.Tensor:
    """Focal loss BCE * (1 - p_t)^gamma * weight, no alpha (as upstream). Shapes as `bce_loss`."""
    z = logits.float().masked_fill(~mask, 0.0)
    bce = F.binary_cross_entropy_with_logits(z, target, reduction="none")
    p = torch.sigmoid(z)
    p_t = p * target + (1 - p) * (1 - target)
    return _row_mean(bce * (1 - p_t).pow(gamma) * weight, mask)


def bpr_loss(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pairwise BPR: mean over each row's (positive, negative) pairs of -log sigmoid(s_pos - s_neg).

    [B, n] inputs; the [B, n, n] pair grid is built per row block, so memory is bounded for large n.
    Rows without both a positive and a negative add 0 (still counted in B).
    """
    z = logits.float()
    pos = mask & (target > 0.5)
    neg = mask & (target <= 0.5)
    losses = []
    for s in range(0, z.shape[0], 64):
        zs, ps, ns = z[s : s + 64], pos[s : s + 64], neg[s : s + 64]
        diff = zs.unsqueeze(2) - zs.unsqueeze(1)  # [b, i(pos), j(neg)]
        pair = ps.unsqueeze(2) & ns.unsqueeze(1)
        lp = F.softplus(-diff).masked_fill(~pair, 0.0)  # -log sigmoid(d) = softplus(-d)
        losses.append(lp.sum((1, 2)) / pair.sum((1, 2)).clamp_min(1))
    return torch.cat(losses).sum() / max(z.shape[0], 1)


def retrieval_loss(
    logits: dict[int, torch.Tensor],
    batch: dict,
    focal: bool = False,
    pairwise: float = 0.0,
) -> torch.Tensor:
    """Pointwise (focal or BCE) loss plus `pairwise` x BPR, averaged over layers. logits: {L: [B, n]}."""
    t, w, m = batch["target"], batch["weight"], batch["mask"]
    per_layer = []
    for z in logits.values():
        loss = focal_loss(z, t, w, m) if focal else bce_loss(z, t, w, m)
        if pairwise:
            loss = loss + pairwise * bpr_loss(z, t, m)
        per_layer.append(loss)
    return torch.stack(per_layer).mean()
