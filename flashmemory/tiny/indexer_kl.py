"""Training the native lightning indexer with a KL loss, DeepSeek-V3.2 style, through forward hooks.

The indexer gets no gradient from the LM loss (top-k returns indices and the block mask is a constant).
Following DeepSeek-V3.2's warm-up, its target is the main attention's distribution over the compressed
entries: the attention probabilities of every head summed, then L1-normalised over the entries a query
can see. Its inputs are detached, so the KL trains only the indexer's own weights and the LM loss trains
everything else. Hooks only; transformers is not patched.

Requires the band attention (`flashmemory.tiny.attention`), which records the compressed-entry
probabilities when the attention module has `_fm_record_comp` set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flashmemory.hf.layers import c4_layer_ids, c4_ratio


def indexer_kl(scores: Tensor, target: Tensor, ratio: int) -> Tensor:
    """Mean over query rows of KL(target || softmax(scores)) over the causally visible entries.

    scores: [B, S, N_c] raw indexer logits (grad); target: [B, S, N_c] >= 0 attention mass (no grad).
    Entry j is visible to query t iff j < (t + 1) // ratio. Rows with no visible entry or no mass are
    skipped. Returns a 0-dim fp32 tensor (0 when no row counts).
    """
    b, s, n = scores.shape
    t = torch.arange(s, device=scores.device)
    visible = torch.arange(n, device=scores.device).view(1, -1) < ((t + 1) // ratio).view(-1, 1)  # [S, N_c]
    target = target.float().masked_fill(~visible, 0.0)
    mass = target.sum(-1, keepdim=True)
    rows = mass.squeeze(-1) > 0  # [B, S]
    if not bool(rows.any()):
        return scores.sum() * 0.0
    p = target / mass.clamp_min(1e-30)
    logq = F.log_softmax(scores.float().masked_fill(~visible, float("-inf")), dim=-1)
    kl = (torch.xlogy(p, p) - p * logq.masked_fill(~visible, 0.0)).sum(-1)  # [B, S]
    return kl[rows].mean()


class IndexerKL:
    """Context manager over a model's c4 layers: detach the indexers' inputs, keep their scores, and have
    the band attention record the compressed-entry probabilities. `loss()` after a forward gives the
    mean KL over c4 layers; `clear()` drops what was kept."""

    def __init__(self, model, config):
        layers = model.model.layers
        self.ids = c4_layer_ids(config)
        self.ratio = c4_ratio(config)
        self.attn = [layers[i].self_attn for i in self.ids]
        self.indexers = [a.compressor.indexer for a in self.attn]
        self.scores: dict[int, Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "IndexerKL":
        for k, (attn, idx) in enumerate(zip(self.attn, self.indexers)):
            attn._fm_record_comp = True
            self._handles.append(idx.register_forward_pre_hook(_detach_inputs, with_kwargs=True))
            self._handles.append(idx.scorer.register_forward_hook(self._keep(k)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for attn in self.attn:
            attn._fm_record_comp = False
            attn._fm_comp_probs = None
        self.clear()

    def _keep(self, k: int):
        def hook(module, args, out):
            self.scores[k] = out

        return hook

    def clear(self) -> None:
        self.scores.clear()
        for attn in self.attn:
            attn._fm_comp_probs = None

    def loss(self) -> Tensor:
        """Mean KL over the c4 layers of the last forward; raises if a layer recorded nothing."""
        losses = []
        for k, attn in enumerate(self.attn):
            target = getattr(attn, "_fm_comp_probs", None)
            if target is None or k not in self.scores:
                raise RuntimeError(
                    f"c4 layer {self.ids[k]}: no indexer scores or attention probabilities "
                    "recorded (is the model on band attention, forward without cache?)"
                )
            losses.append(indexer_kl(self.scores[k], target, self.ratio))
        return torch.stack(losses).mean()


def _detach_inputs(module, args, kwargs):
    args = tuple(a.detach() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
    kwargs = {k: (v.detach() if isinstance(v, Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
    return args, kwargs


def set_index_topk(model, config, k: int) -> None:
    """Set every c4 indexer's top-k width at runtime (training keeps c4 attention dense with a large k)."""
    for i in c4_layer_ids(config):
        model.model.layers[i].self_attn.compressor.indexer.index_topk = int(k)
