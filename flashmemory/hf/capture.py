"""Forward hooks on transformers' DeepSeek-V4 lightning indexers: capture, and the Level-2 mask.

How transformers 5.19 computes the CSA indexer (read from `DeepseekV4Indexer.forward`):

- Prefill without a cache compresses only complete windows: N_c = S // 4 entries; the last S % 4
  tokens give no entry. Entry j pools tokens [4j-4, 4j+4) (the Ca half of window j-1 and the Cb
  half of window j, per-channel softmax over 8 slots; entry 0 has only its own 4 Cb slots), then
  RMSNorm and interleaved RoPE (compress theta + YaRN) on the last rope dims at position 4j.
  With a cache, decode emits entry j when token 4j+3 arrives and keeps the Ca overlap state, so
  the keys match prefill. No Hadamard rotation or FP4/FP8 simulation happens here.
- `scorer(q, keys, x)` returns I[t, j] = sum_h w[t,h] * relu(q[t,h] . k[j]) / sqrt(D), w =
  weights_proj(x) / sqrt(H), for ALL N_c entries; x is the attention input (input_layernorm of the
  hc_pre-collapsed stream), the tensor sglang's C4 indexer receives.
- The indexer then sets I[t, j] = -inf for j >= (t+1) // 4 (entry j is complete only once token
  4j+3 has been seen), takes top-min(index_topk, N_c), and turns picks j >= (t+1)//4 into -1.
  The CSA compressor lets query t attend exactly its picks >= 0 (plus the sliding window).

The hooks below wrap `scorer` (capture, and -inf for non-resident entries before top-k) and the
indexer (picks whose masked score is -inf become -1, so a non-resident entry is never attended
even when fewer than k entries are finite). Hooks are removed on exit; transformers is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from flashmemory.hf.layers import c4_layer_ids, c4_ratio

NEG_INF = float("-inf")


@dataclass
class IndexerRecord:
    """What the hooks saw, keyed by c4-layer id; filled only when recording."""

    index_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # [S, N_c] fp32, -inf not visible
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # [S, index_topk] int64, -1 invalid
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # [S, hidden] fp32
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # [N_c, index_head_dim] fp32


def indexer_modules(model: nn.Module, config) -> list[nn.Module]:
    """The `DeepseekV4Indexer` of every c4 layer, in c4-layer-id order."""
    layers = model.model.layers
    out = []
    for li in c4_layer_ids(config):
        comp = getattr(layers[li].self_attn, "compressor", None)
        idx = getattr(comp, "indexer", None)
        if idx is None or not hasattr(idx, "scorer"):
            raise ValueError(f"model layer {li} is a CSA layer but has no self_attn.compressor.indexer.scorer")
        out.append(idx)
    return out


def _arg(args: tuple, kwargs: dict, pos: int, name: str):
    return kwargs[name] if name in kwargs else args[pos]


def not_resident(resident: torch.Tensor, positions: torch.Tensor, n_entries: int) -> torch.Tensor:
    """Bool [S, n] or [1, n]: True where an entry is NOT resident for the query at `positions` [S].

    `resident` is [N] (one mask for every query) or [R, N] (row = absolute query position).
    """
    if resident.shape[-1] < n_entries:
        raise ValueError(
            f"resident mask covers {resident.shape[-1]} compressed entries but the indexer "
            f"scores {n_entries}; give at least {n_entries} columns"
        )
    if resident.dim() == 1:
        return ~resident[:n_entries].unsqueeze(0)
    if int(positions.max()) >= resident.shape[0]:
        raise ValueError(
            f"resident mask has {resident.shape[0]} rows but a query sits at position {int(positions.max())}"
        )
    return ~resident[positions, :n_entries]


class IndexerHooks:
    """Context manager: hooks every c4 indexer of `model` for one or more forwards.

    resident: None, or bool [N] / [R, N] (see `not_resident`); applied in every c4 layer.
    capture: c4-layer ids whose indexer-input hidden and compressed keys are recorded.
    record: keep index_logits / topk of every c4 layer (the last forward call wins).
    Batch size must be 1.
    """

    def __init__(
        self,
        model: nn.Module,
        config,
        resident: torch.Tensor | None = None,
        capture: list[int] | tuple[int, ...] = (),
        record: bool = True,
    ):
        self.indexers = indexer_modules(model, config)
        self.ratio = c4_ratio(config)
        self.topk_width = int(config.index_topk)
        self.resident = resident
        self.capture = set(capture)
        self.record_on = record
        self.record = IndexerRecord()
        self._positions: dict[int, torch.Tensor] = {}
        self._masked: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "IndexerHooks":
        try:
            for cid, idx in enumerate(self.indexers):
                self._handles.append(idx.register_forward_pre_hook(self._pre_hook(cid), with_kwargs=True))
                self._handles.append(idx.register_forward_hook(self._indexer_hook(cid)))
                self._handles.append(idx.scorer.register_forward_hook(self._scorer_hook(cid), with_kwargs=True))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._positions.clear()
        self._masked.clear()

    def _pre_hook(self, cid: int):
        def hook(module, args, kwargs):
            pos = _arg(args, kwargs, 2, "position_ids")
            if pos.shape[0] != 1:
                raise ValueError(f"IndexerHooks supports batch size 1, got position_ids {tuple(pos.shape)}")
            self._positions[cid] = pos[0]

        return hook

    def _scorer_hook(self, cid: int):
        def hook(module, args, kwargs, scores):
            keys = _arg(args, kwargs, 1, "compressed_kv")  # [1, N_c, D]
            hidden = _arg(args, kwargs, 2, "hidden_states")  # [1, S, hidden]
            pos = self._positions[cid]
            n = scores.shape[-1]
            future = torch.arange(n, device=scores.device).unsqueeze(0) >= ((pos + 1) // self.ratio).unsqueeze(1)
            if self.record_on:
                self.record.index_logits[cid] = scores[0].float().masked_fill(future, NEG_INF)
                if cid in self.capture:
                    self.record.hidden[cid] = hidden[0].detach().float().clone()
                    self.record.index_keys[cid] = keys[0].detach().float().clone()
            if self.resident is not None:
                scores = scores.masked_fill(not_resident(self.resident, pos, n).unsqueeze(0), NEG_INF)
            self._masked[cid] = scores.masked_fill(future.unsqueeze(0), NEG_INF)
            return scores

        return hook

    def _indexer_hook(self, cid: int):
        def hook(module, args, picks):
            masked = self._masked.pop(cid, None)
            if masked is not None and picks.numel():
                # -inf picks are future (already -1) or non-resident entries top-k had to take.
                score = masked.gather(-1, picks.clamp_min(0))
                picks = torch.where((picks >= 0) & (score != NEG_INF), picks, torch.full_like(picks, -1))
            if self.record_on:
                pad = self.topk_width - picks.shape[-1]
                out = picks[0]
                if pad > 0:
                    out = torch.cat([out, out.new_full((out.shape[0], pad), -1)], dim=-1)
                self.record.topk[cid] = out.long()
            return picks

        return hook
