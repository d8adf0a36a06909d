"""Pin the top-k decisions of a transformers DeepSeek-V4 forward to a reference forward's, through forward hooks.

A DeepSeek-V4 forward makes two kinds of top-k decision: every c4 lightning indexer picks its top-`index_topk`
compressed entries per query (`DeepseekV4Indexer`, scores from its `scorer` [B, S, N_c] fp32, picks [B, S, k]
int64 with -1 for not-yet-visible entries), and every learned MoE gate picks its top-`num_experts_per_tok` experts
per token (`DeepseekV4TopKRouter`, returning (logits [T, E], weights [T, k], indices [T, k]); hash-routed layers
pick by token id and make no float decision).

`PinnedTopk.record()` keeps both on a reference run; `PinnedTopk.replay()` runs other forwards over positions
inside it (the same forward on another code path, a prefix, chunked prefill, cached decode steps) and, at each
decision, checks its scores against the reference's (`assert_scores_close`) and its picks
(`assert_picks_agree`: any pick that differs must be a near-tie), then substitutes the reference picks (the gate
weights are recomputed from the replayed side's own logits at those picks). The two forwards then differ only by
the rounding of the computation under test, so their outputs can be compared tightly. Hooks only; the model
is unchanged after the context exits. Hooks of others registered before these (e.g. the engine's residency mask)
run first, so what is recorded is what the model's top-k saw.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from tests.topk_ties import PickDiff, assert_picks_agree, assert_scores_close


def _decision_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module for every lightning indexer and learned (non-hash) MoE gate of the model."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer, DeepseekV4TopKRouter

    return {n: m for n, m in model.named_modules() if isinstance(m, (DeepseekV4Indexer, DeepseekV4TopKRouter))}


def _gate_scores(gate: nn.Module, logits: Tensor) -> Tensor:
    """The values a learned gate ranks: its score function of the logits plus the correction bias, [T, E]."""
    return gate.score_fn(logits) + gate.e_score_correction_bias


def _gate_weights(gate: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Routing weights of `indices` [T, k] from `logits` [T, E]: scores at the picks, L1-normalised, scaled."""
    picked = gate.score_fn(logits).gather(1, indices)
    return picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor


class PinnedTopk:
    """Record the top-k decisions of a reference run, then replay them into other forwards (see module doc).

    The reference run covers positions 0 .. S - 1 of one [B, S] token sequence, in one cacheless forward or in
    several forwards over consecutive positions with a cache (prefill then decode steps: what `HFEngine.generate`
    does). A replayed forward may cover any positions start .. start + T - 1 inside it, with or without a cache:
    by causality its scores and picks are the reference's rows at those positions. Indexer scores are compared
    on the entries visible to each query (j < (t + 1) // compress_rate; the others are -inf on both sides).
    rtol / atol: the score tolerance of both checks (`tests.topk_ties.row_tolerance`). After a replay, `diffs`
    holds one `PickDiff` per decision (module name, call index) and `near_ties` counts the rows whose picks
    differed by a near-tie and were pinned.

    The hooks are registered at the start of each model forward (a pre-hook on the decoder stack) and removed at
    its end, so they run after hooks others registered before that forward (e.g. `HFEngine`'s residency mask,
    which sets non-resident scores to -inf and their picks to -1): what is checked and pinned is what the model's
    top-k saw and what it then attended.
    """

    def __init__(self, model: nn.Module, *, rtol: float, atol: float):
        self.model = model
        self.modules = _decision_modules(model)
        if not self.modules:
            raise ValueError("model has no DeepseekV4Indexer or DeepseekV4TopKRouter to pin")
        self.rtol, self.atol = rtol, atol
        self.ref: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (scores [B, S, N], picks [B, S, k])
        self.diffs: dict[tuple[str, int], PickDiff] = {}
        self._chunks: dict[str, list[tuple[int, Tensor, Tensor]]] = {}
        self._replay = False
        self._calls: dict[str, int] = {}
        self._scores: dict[str, Tensor] = {}
        self._span: tuple[int, int, int] = (0, 0, 0)  # (batch, start, length) of the running forward
        self._inner: list = []

    @property
    def near_ties(self) -> int:
        return sum(len(d.near_tie_rows) for d in self.diffs.values())

    @contextmanager
    def record(self) -> Iterator["PinnedTopk"]:
        self.ref.clear()
        self._chunks.clear()
        with self._hooks(replay=False):
            yield self
        assert self._chunks, "no top-k decision recorded (did the block run a forward?)"
        self.ref = {name: _assemble(name, chunks) for name, chunks in self._chunks.items()}
        self._chunks.clear()

    @contextmanager
    def replay(self) -> Iterator["PinnedTopk"]:
        if not self.ref:
            raise RuntimeError("PinnedTopk.replay before any recorded forward")
        self.diffs.clear()
        with self._hooks(replay=True):
            yield self
        assert self.diffs, "the replayed block made no top-k decision"

    @contextmanager
    def _hooks(self, replay: bool) -> Iterator[None]:
        self._replay = replay
        self._calls.clear()
        stack = self.model.model
        outer = [stack.register_forward_pre_hook(self._begin, with_kwargs=True), stack.register_forward_hook(self._end)]
        try:
            yield
        finally:
            for h in outer:
                h.remove()
            self._end()

    def _begin(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        cache = kwargs.get("past_key_values")
        start = cache.get_seq_length() if cache is not None else 0
        if kwargs.get("position_ids") is not None:
            start = int(kwargs["position_ids"].reshape(-1)[0])
        self._span = (int(ids.shape[0]), int(start), int(ids.shape[1]))
        for name, mod in self.modules.items():
            if hasattr(mod, "scorer"):
                self._inner.append(mod.scorer.register_forward_hook(self._keep_scores(name)))
            self._inner.append(mod.register_forward_hook(self._decide(name)))

    def _end(self, *_) -> None:
        for h in self._inner:
            h.remove()
        self._inner.clear()
        self._scores.clear()

    def _keep_scores(self, name: str):
        def hook(module, args, out):
            self._scores[name] = out.detach()

        return hook

    def _decide(self, name: str):
        def hook(module, args, out):
            b, start, t = self._span
            gate = isinstance(out, tuple)  # MoE gate: (logits [B*T, E], weights, indices [B*T, k])
            if gate:
                scores = _gate_scores(module, out[0].detach()).reshape(b, t, -1)
                picks = out[2].reshape(b, t, -1)
            else:  # lightning indexer: picks [B, T, k]; its scorer's output [B, T, N] was kept just before
                picks, scores = out, _visible(self._scores.pop(name), start, module.compress_rate)
            if not self._replay:
                self._chunks.setdefault(name, []).append((start, scores.clone(), picks.clone()))
                return None
            n = scores.shape[-1]
            if n == 0 or picks.shape[-1] == 0:  # an indexer with no compressed entry yet: nothing to pick
                return None
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            ref_scores, ref_picks = self.ref[name]
            what = f"{name} (call {call}, positions {start}..{start + t - 1})"
            assert ref_scores.shape[0] == b and start + t <= ref_scores.shape[1], (
                f"{what}: outside the reference run {tuple(ref_scores.shape)}"
            )
            ref_scores = _width(ref_scores[:, start : start + t], n, float("-inf"))
            ref_picks = _fit_width(ref_picks[:, start : start + t], picks.shape[-1], what)
            assert_scores_close(ref_scores, scores, rtol=self.rtol, atol=self.atol, what=what)
            self.diffs[(name, call)] = assert_picks_agree(
                ref_scores, ref_picks, scores, picks, rtol=self.rtol, atol=self.atol, what=what
            )
            if gate:
                idx = ref_picks.reshape(b * t, -1)
                return out[0], _gate_weights(module, out[0], idx), idx
            return ref_picks

        return hook


def _visible(scores: Tensor, start: int, ratio: int) -> Tensor:
    """Indexer scores [B, T, N] of queries at positions start .. start + T - 1 with -inf where entry j is not yet
    visible to the query (j >= (t + 1) // ratio): the values the indexer's top-k ranks."""
    t = torch.arange(start, start + scores.shape[1], device=scores.device)
    future = torch.arange(scores.shape[2], device=scores.device).view(1, -1) >= ((t + 1) // ratio).view(-1, 1)
    return scores.masked_fill(future.unsqueeze(0), float("-inf"))


def _width(x: Tensor, n: int, fill: float) -> Tensor:
    """x [B, T, m] cut or right-padded with `fill` to [B, T, n]."""
    if x.shape[-1] >= n:
        return x[..., :n]
    return torch.cat([x, x.new_full((*x.shape[:-1], n - x.shape[-1]), fill)], dim=-1)


def _assemble(name: str, chunks: list[tuple[int, Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Concatenate recorded forwards over consecutive positions from 0 into (scores [B, S, N], picks [B, S, k]);
    narrower chunks (early decode steps see fewer entries) are padded with -inf scores and -1 picks."""
    pos = 0
    for start, scores, _ in chunks:
        assert start == pos, f"{name}: the reference run must cover consecutive positions from 0 (got {start} at {pos})"
        pos += scores.shape[1]
    n = max(c[1].shape[-1] for c in chunks)
    k = max(c[2].shape[-1] for c in chunks)
    return (
        torch.cat([_width(c[1], n, float("-inf")) for c in chunks], dim=1),
        torch.cat([_width(c[2], k, -1) for c in chunks], dim=1),
    )


def _fit_width(picks: Tensor, k: int, what: str) -> Tensor:
    """picks [B, T, k_ref] (-1 invalid) -> [B, T, k]: valid picks first (their order kept), -1 padding; fails if a
    row holds more than k valid picks (the replayed top-k could not have taken them)."""
    if picks.shape[-1] == k:
        return picks
    order = torch.sort((picks < 0).to(torch.int8), dim=-1, stable=True).indices
    packed = picks.gather(-1, order)
    assert k >= picks.shape[-1] or bool((packed[..., k:] < 0).all()), f"{what}: more valid reference picks than {k}"
    return _width(packed, k, -1)
