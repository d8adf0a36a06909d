"""Band attention for DeepSeek-V4 full forwards: the sliding-window band plus the compressed entries.

transformers' eager DeepSeek-V4 attention scores every query against every raw token ([B, H, S, S + N_c])
although the mask keeps only the last `sliding_window` raw tokens. `band_attention` computes the same
softmax over just the band [B, H, S, W] and the compressed columns [B, H, S, N_c] (plus the per-head sink),
so a full forward costs O(S * (W + S / 4)) instead of O(S^2). It is registered through transformers'
`AttentionInterface` (and `AttentionMaskInterface`, reusing the eager mask) under `BAND_ATTENTION`; no
transformers code is patched.

It applies only to a cacheless full forward from position 0 (the raw keys are exactly the S query
tokens, followed by the compressed entries); anything else (cached decode, chunked prefill) falls back to
eager, so a model left on this implementation still decodes correctly.

Training knobs live on the attention module as plain attributes (absent = off):
- `_fm_record_comp`: when True, the head-summed attention probabilities over the compressed entries
  (detached, fp32 [B, S, N_c]) are stored in `_fm_comp_probs` (the indexer KL target);
- `_fm_drop_comp`: a probability; while training, each compressed column of this layer is masked
  for the whole batch row with that probability (used on c128 layers so retrieval must use c4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BAND_ATTENTION = "fm_band"


def _eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def band_scores_layout(q_len: int, k_len: int, module) -> int | None:
    """Number of compressed columns when (q_len, k_len) is a cacheless forward from position 0, else None."""
    comp = getattr(module, "compressor", None)
    n_c = 0 if comp is None else q_len // int(comp.compress_rate)
    return n_c if k_len == q_len + n_c and q_len > 1 else None


def band_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
):
    """query [B, H, S, D]; key = value [B, 1, S + N_c, D] (raw tokens, then compressed entries);
    attention_mask float [B, 1, S, S + N_c] (0 / -inf; only its compressed columns are read: the raw part
    is the causal band of width W = sliding_window, recomputed here). Returns ([B, S, H, D], None).
    The band holds keys t-W+1 .. t for query t (transformers' `kv_idx > q_idx - W`)."""
    b, h, s, d = query.shape
    n_c = band_scores_layout(s, key.shape[2], module)
    w = int(sliding_window or module.sliding_window)
    if n_c is None or attention_mask is None or key.shape[1] != 1 or (dropout and module.training):
        return _eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    raw, comp = key[:, 0, :s], key[:, 0, s:]  # [B, S, D], [B, N_c, D]
    padded = F.pad(raw, (0, 0, w - 1, 0))  # [B, S + W - 1, D]
    band = padded.unfold(1, w, 1)  # [B, S, D, W]; column i is key t - W + 1 + i
    band_logits = torch.einsum("bhsd,bsdw->bhsw", query, band) * scaling
    pos = torch.arange(s, device=query.device).unsqueeze(1) - (w - 1) + torch.arange(w, device=query.device)
    band_logits = band_logits.masked_fill((pos < 0).view(1, 1, s, w), float("-inf"))
    parts = [band_logits]
    if n_c:
        comp_mask = attention_mask[..., s:].to(band_logits.dtype)  # [B, 1, S, N_c]
        drop = getattr(module, "_fm_drop_comp", 0.0)
        if module.training and drop > 0:
            keep = torch.rand(b, 1, 1, n_c, device=query.device) >= drop
            comp_mask = comp_mask.masked_fill(~keep, float("-inf"))
        parts.append(torch.matmul(query, comp.unsqueeze(1).transpose(-1, -2)) * scaling + comp_mask)
    parts.append(module.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1).to(band_logits.dtype))
    logits = torch.cat(parts, dim=-1)
    probs = torch.softmax(logits.float(), dim=-1).to(value.dtype)
    out = torch.einsum("bhsw,bsdw->bhsd", probs[..., :w], band)
    if n_c:
        p_comp = probs[..., w : w + n_c]
        out = out + torch.matmul(p_comp, comp.unsqueeze(1))
        if getattr(module, "_fm_record_comp", False):
            module._fm_comp_probs = p_comp.detach().float().sum(1)
    return out.transpose(1, 2).contiguous(), None


def register_band_attention() -> str:
    """Register `band_attention` (and the eager mask builder) under `BAND_ATTENTION`; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(BAND_ATTENTION, band_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(BAND_ATTENTION, eager_mask)
    return BAND_ATTENTION


def use_band_attention(model, on: bool = True) -> None:
    """Switch a DeepseekV4ForCausalLM between band attention (on) and transformers' eager attention."""
    if on:
        register_band_attention()
        model.set_attn_implementation(BAND_ATTENTION)
    else:
        model.set_attn_implementation("eager")
