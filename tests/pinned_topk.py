"""Pin the top-k decisions of a transformers DeepSeek-V4 forward to a reference forward's, through forward hooks.

A DeepSeek-V4 forward makes two kinds of top-k decision: every c4 lightning indexer picks its top-`index_topk`
compressed entries per query (`DeepseekV4Indexer`, scores from its `scorer` [B, S, N_c] fp32, picks [B, S, k]
int64 with -1 for not-yet-visible entries), and every learned MoE gate picks its top-`num_experts_per_tok` experts
per token (`DeepseekV4TopKRouter`, returning (logits [T, E], weights [T, k], indices [T, k]); hash-routed layers
pick by token id and make no float decision).

`PinnedTopk.record()` keeps both on a reference forward; `PinnedTopk.replay()` runs a second forward of the same
shape and, at each decision, checks its scores against the reference's (`assert_scores_close`) and its picks
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
    """Record a reference forward's top-k decisions, then replay them into a second forward (see module doc).

    rtol / atol: the score tolerance of both checks (`tests.topk_ties.row_tolerance`). After a replay,
    `diffs` holds one `PickDiff` per decision (module name, call index) and `near_ties` counts the rows
    whose picks differed by a near-tie and were pinned.
    """

    def __init__(self, model: nn.Module, *, rtol: float, atol: float):
        self.modules = _decision_modules(model)
        if not self.modules:
            raise ValueError("model has no DeepseekV4Indexer or DeepseekV4TopKRouter to pin")
        self.rtol, self.atol = rtol, atol
        self.ref: dict[tuple[str, int], tuple[Tensor, Tensor]] = {}  # (name, call) -> (scores, picks)
        self.diffs: dict[tuple[str, int], PickDiff] = {}
        self._calls: dict[str, int] = {}
        self._scores: dict[str, Tensor] = {}

    @property
    def near_ties(self) -> int:
        return sum(len(d.near_tie_rows) for d in self.diffs.values())

    @contextmanager
    def record(self) -> Iterator["PinnedTopk"]:
        self.ref.clear()
        with self._hooks(replay=False):
            yield self

    @contextmanager
    def replay(self) -> Iterator["PinnedTopk"]:
        if not self.ref:
            raise RuntimeError("PinnedTopk.replay before any recorded forward")
        self.diffs.clear()
        with self._hooks(replay=True):
            yield self
        missing = set(self.ref) - set(self.diffs)
        assert not missing, f"replayed forward made fewer top-k decisions than the reference: {sorted(missing)[:3]}"

    @contextmanager
    def _hooks(self, replay: bool) -> Iterator[None]:
        self._calls.clear()
        handles = []
        try:
            for name, mod in self.modules.items():
                if hasattr(mod, "scorer"):
                    handles.append(mod.scorer.register_forward_hook(self._keep_scores(name)))
                handles.append(mod.register_forward_hook(self._decide(name, replay)))
            yield
        finally:
            for h in handles:
                h.remove()
            self._scores.clear()

    def _keep_scores(self, name: str):
        def hook(module, args, out):
            self._scores[name] = out.detach()
        return hook

    def _decide(self, name: str, replay: bool):
        def hook(module, args, out):
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            key = (name, call)
            if isinstance(out, tuple):  # MoE gate: (logits, weights, indices)
                logits, _, picks = out
                scores = _gate_scores(module, logits.detach())
            else:  # lightning indexer: picks; its scorer's output was kept just before
                picks, scores = out, self._scores.pop(name)
            if not replay:
                self.ref[key] = (scores.clone(), picks.clone())
                return None
            assert key in self.ref, f"{name}: call {call} has no recorded reference"
            ref_scores, ref_picks = self.ref[key]
            what = f"{name} (call {call})"
            assert_scores_close(ref_scores, scores, rtol=self.rtol, atol=self.atol, what=what)
            self.diffs[key] = assert_picks_agree(ref_scores, ref_picks, scores, picks,
                                                 rtol=self.rtol, atol=self.atol, what=what)
            if isinstance(out, tuple):
                return out[0], _gate_weights(module, out[0], ref_picks), ref_picks
            return ref_picks
        return hook
