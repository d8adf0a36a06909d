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
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(frozen=True)
class StepDiff:
    max_abs: float        # max |logprob a - logprob b| over the vocabulary
    agree: bool           # same argmax
    ref_margin: float     # top-1 minus top-2 logprob of b (the reference)


def logprob_rows(meta_info: dict, vocab: int) -> torch.Tensor:
    """sglang's `output_top_logprobs` (one list of (logprob, id, text) per step) -> fp32 [steps, vocab]."""
    rows = meta_info["output_top_logprobs"]
    out = torch.full((len(rows), vocab), float("-inf"))
    for i, row in enumerate(rows):
        for lp, tok, *_ in row:
            out[i, int(tok)] = float(lp)
    if not torch.isfinite(out).all():
        raise ValueError("sglang returned fewer log-probs than the vocabulary; request top_logprobs_num=vocab")
    return out


@contextmanager
def fp8_kv_simulation(model: torch.nn.Module) -> Iterator[int]:
    """Quantize-dequantize every 512-wide KV entry (nope dims 0..447 only; the rope dims are stored as bf16)
    as sglang's 584-B store does, via forward hooks on the kv_norm modules. Yields the number of hooks."""
    from flashmemory.sglang.cpu.stores import dequantize_kv_entries, quantize_kv_entries

    def hook(_mod, _inp, out):
        flat = out.reshape(-1, out.shape[-1]).float()
        deq = dequantize_kv_entries(quantize_kv_entries(flat, round_nope_to_bf16=True))
        rope = flat[:, 448:].bfloat16().float()
        return torch.cat([deq[:, :448], rope], dim=1).to(out.dtype).reshape(out.shape)

    handles = [m.register_forward_hook(hook) for name, m in model.named_modules()
               if name.endswith("kv_norm") and getattr(m, "weight", None) is not None and m.weight.shape[0] == 512]
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()


def reference_logprobs(model: torch.nn.Module, prompt: list[int], generated: list[int],
                       fp8_kv: bool = False) -> torch.Tensor:
    """fp32 [len(generated), vocab] next-token log-probs of `model` teacher-forced on prompt + generated."""
    ids = torch.tensor([list(prompt) + list(generated[:-1])], dtype=torch.long)
    ctx = fp8_kv_simulation(model) if fp8_kv else _nothing()
    with torch.no_grad(), ctx:
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def compare(a: torch.Tensor, b: torch.Tensor) -> list[StepDiff]:
    """Per-step differences of log-prob rows a, b [steps, vocab] (b is the reference)."""
    out = []
    top2 = b.topk(2, dim=-1).values
    for i in range(a.shape[0]):
        out.append(StepDiff(float((a[i] - b[i]).abs().max()), bool(a[i].argmax() == b[i].argmax()),
                            float(top2[i, 0] - top2[i, 1])))
    return out


def summary(diffs: list[StepDiff]) -> dict:
    return {"max_abs": max(d.max_abs for d in diffs), "mean_max_abs": sum(d.max_abs for d in diffs) / len(diffs),
            "agree": sum(d.agree for d in diffs), "steps": len(diffs)}
