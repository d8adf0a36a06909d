"""sglang-on-CPU against the transformers engine on the same checkpoint: next-token log-probs and greedy tokens.

Metric. sglang returns the full next-token distribution of every generated step (top_logprobs_num = vocab).
The transformers model is teacher-forced on the same prompt + sglang's tokens, so both score the same
contexts. Per step: `max_abs` = max over the vocabulary of |logprob_sglang - logprob_ref|, and whether the
greedy pick agrees (a disagreement only counts where the reference's top-1 margin exceeds the noise).

Noise bound. sglang stores the SWA and compressed KV as fp8 e4m3 with power-of-two group scales (and runs in
bf16); transformers keeps them in full precision. `fp8_kv` re-runs the reference with that quantization
simulated on every 512-wide KV entry (main attention and c4/c128 compressors: forward hooks on their
`kv_norm`, dequantized back through the same 584-B codec sglang's stores use), and `bf16` runs it in bf16.
Their distance to the fp32 reference measures the expected noise; sglang must stay within a small multiple.
The index-K fp8 (132-B) and the indexer-query fp8 are not simulated: with <= 512 compressed entries every
entry is picked anyway, so they cannot change the attended set at these lengths.

Tolerance (`judge`). noise[i] = max(fp8_kv distance, bf16 distance) at step i. sglang carries both error
sources at once; to first order they add, so |sglang - ref| <= |fp8 effect| + |bf16 effect| <= 2 max(noise):
`bound = multiple * max_i noise[i]` with multiple 2. Greedy tokens must agree wherever the reference's top-1
margin exceeds 2 noise[i] (a margin closes only if top-1 falls and top-2 rises, each by at most the step's
|delta|). sglang's emitted token must also be a maximiser of its own returned row (sampler vs logprob path).
Measured numbers and why the test model uses init_std 0.02: `flashmemory/sglang/cpu/README.md`, Equivalence.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepDiff:
    max_abs: float  # max |logprob a - logprob b| over the vocabulary
    agree: bool  # same argmax
    ref_margin: float  # top-1 minus top-2 logprob of b (the reference)


def logprob_rows(meta_info: dict, vocab: int) -> torch.Tensor:
    """sglang's `output_top_logprobs` (one list of (logprob, id, text) per step) -> fp32 [steps, vocab].

    Every row must hold a finite log-prob for every id in [0, vocab) (request top_logprobs_num=vocab)."""
    rows = meta_info.get("output_top_logprobs") if isinstance(meta_info, dict) else None
    if not rows:
        raise ValueError(
            "meta_info.output_top_logprobs is missing or empty; request return_logprob=True and top_logprobs_num=vocab"
        )
    out = torch.full((len(rows), vocab), float("-inf"))
    for i, row in enumerate(rows):
        for lp, tok, *_ in row:
            if not 0 <= int(tok) < vocab:
                raise ValueError(f"meta_info.output_top_logprobs[{i}]: token id {tok} outside [0, {vocab})")
            if lp is None or not math.isfinite(float(lp)):
                raise ValueError(f"meta_info.output_top_logprobs[{i}]: non-finite log-prob {lp!r} for id {tok}")
            out[i, int(tok)] = float(lp)
    missing = int((~torch.isfinite(out)).sum())
    if missing:
        raise ValueError(
            f"meta_info.output_top_logprobs: {missing} (step, id) log-probs missing; request top_logprobs_num=vocab"
        )
    return out


@contextmanager
def fp8_kv_simulation(model: torch.nn.Module) -> Iterator[int]:
    """Quantize-dequantize every 512-wide KV entry (nope dims 0..447 only; the rope dims are stored as bf16)
    as sglang's 584-B store does, via forward hooks on the kv_norm modules. Yields the number of hooks."""
    from flashmemory.sglang.cpu.ops.stores import dequantize_kv_entries, quantize_kv_entries

    def hook(_mod, _inp, out):
        flat = out.reshape(-1, out.shape[-1]).float()
        deq = dequantize_kv_entries(quantize_kv_entries(flat, round_nope_to_bf16=True))
        rope = flat[:, 448:].bfloat16().float()
        return torch.cat([deq[:, :448], rope], dim=1).to(out.dtype).reshape(out.shape)

    handles = [
        m.register_forward_hook(hook)
        for name, m in model.named_modules()
        if name.endswith("kv_norm") and getattr(m, "weight", None) is not None and m.weight.shape[0] == 512
    ]
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], generated: list[int], fp8_kv: bool = False, bf16: bool = False
) -> torch.Tensor:
    """fp32 [len(generated), vocab] next-token log-probs of `model` teacher-forced on prompt + generated.

    fp8_kv: simulate sglang's fp8 KV stores (`fp8_kv_simulation`). bf16: run under CPU bf16 autocast (the
    matmuls in bf16, like sglang's bf16 GEMMs). Autocast, not a bf16 model: transformers 5.19's DSv4 keeps the
    mHC streams in fp32, so a bf16 model fails at the first projection (fp32 input, bf16 weight)."""
    if not generated:
        raise ValueError("generated is empty: nothing to score")
    ids = torch.tensor([list(prompt) + list(generated[:-1])], dtype=torch.long)
    ctx = fp8_kv_simulation(model) if fp8_kv else _nothing()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else _nothing()
    with torch.no_grad(), ctx, amp:
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def compare(a: torch.Tensor, b: torch.Tensor) -> list[StepDiff]:
    """Per-step differences of log-prob rows a, b [steps, vocab] (b is the reference)."""
    if a.shape != b.shape or a.dim() != 2 or a.shape[0] == 0 or a.shape[1] < 2:
        raise ValueError(
            f"compare needs two equal [steps >= 1, vocab >= 2] tensors, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    out = []
    top2 = b.topk(2, dim=-1).values
    for i in range(a.shape[0]):
        out.append(
            StepDiff(
                float((a[i] - b[i]).abs().max()), bool(a[i].argmax() == b[i].argmax()), float(top2[i, 0] - top2[i, 1])
            )
        )
    return out


def summary(diffs: list[StepDiff]) -> dict:
    return {
        "max_abs": max(d.max_abs for d in diffs),
        "mean_max_abs": sum(d.max_abs for d in diffs) / len(diffs),
        "agree": sum(d.agree for d in diffs),
        "steps": len(diffs),
    }


MULTIPLE = 2.0  # sglang carries the fp8-KV and the bf16 error at once: to first order they add (module doc)


@dataclass(frozen=True)
class Verdict:
    """sglang [steps, vocab] log-probs and tokens judged against the fp32 reference and its measured noise."""

    sglang: list[StepDiff]  # sglang vs fp32 reference, per step
    fp8_kv: list[float]  # per step: max |delta| of the fp8-KV-simulated reference to the fp32 one
    bf16: list[float]  # per step: the same for the bf16 reference
    noise: list[float]  # per step: max(fp8_kv, bf16)
    bound: float  # multiple * max(noise): the allowed max |delta logprob|
    greedy_checked: list[int]  # steps whose reference margin > 2 noise[step]
    failures: list[str]  # empty = equivalent

    @property
    def max_abs(self) -> float:
        return max(d.max_abs for d in self.sglang)


def judge(
    sg: torch.Tensor,
    tokens: list[int],
    ref: torch.Tensor,
    fp8: torch.Tensor,
    bf16: torch.Tensor,
    multiple: float = MULTIPLE,
) -> Verdict:
    """Compare sglang's rows `sg` and emitted `tokens` with the fp32 reference `ref`; `fp8` and `bf16` are the
    reference re-run with fp8-KV simulation and in bf16 (all fp32 [steps, vocab] log-probs, same contexts)."""
    if len(tokens) != sg.shape[0]:
        raise ValueError(f"{len(tokens)} tokens for {sg.shape[0]} log-prob rows")
    diffs = compare(sg, ref)
    n8, n16 = [d.max_abs for d in compare(fp8, ref)], [d.max_abs for d in compare(bf16, ref)]
    noise = [max(a, b) for a, b in zip(n8, n16)]
    bound = multiple * max(noise)
    failures = []
    worst = max(range(len(diffs)), key=lambda i: diffs[i].max_abs)
    if diffs[worst].max_abs > bound:
        failures.append(
            f"max |delta logprob| {diffs[worst].max_abs:.4g} at step {worst} exceeds {multiple:g} x "
            f"noise {max(noise):.4g} = {bound:.4g}"
        )
    ref_top = ref.argmax(-1).tolist()
    checked = [i for i, d in enumerate(diffs) if d.ref_margin > 2 * noise[i]]
    for i in checked:
        if tokens[i] != ref_top[i]:
            failures.append(
                f"step {i}: sglang emitted {tokens[i]}, reference argmax {ref_top[i]} with margin "
                f"{diffs[i].ref_margin:.4g} > 2 x noise {noise[i]:.4g}"
            )
    for i, t in enumerate(tokens):
        if not 0 <= t < sg.shape[1] or sg[i, t] < sg[i].max():
            failures.append(f"step {i}: sglang emitted {t}, not a maximiser of its own log-probs")
    return Verdict(diffs, n8, n16, noise, bound, checked, failures)
