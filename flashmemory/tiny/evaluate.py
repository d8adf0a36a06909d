"""Teacher-forced answer accuracy of a DeepSeek-V4 model on curriculum documents.

A document counts as correct when the argmax at every answer position equals the answer token (the same
as greedy decoding reproducing the answer exactly, `<|end|>` included). Digit accuracy is the share of
answer digit tokens predicted correctly (chance 1/10), a finer signal for numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmemory.tiny.data import Doc, collate


@dataclass(frozen=True)
class DocResult:
    task: str
    exact: bool
    n_tokens: int
    n_correct: int
    correct: tuple[bool, ...]  # per answer token
    argmax: tuple[int, ...]  # per answer token


def pad_id() -> int:
    from flashmemory.tasks.tokenizer import load_tokenizer

    return load_tokenizer(None).ids["<|end|>"]


@torch.no_grad()
def score_docs(
    model, docs: list[Doc], batch_size: int = 16, device: str | torch.device = "cpu", autocast: bool = False
) -> list[DocResult]:
    """Teacher-forced results for each document, in order."""
    out: list[DocResult] = []
    pid = pad_id()
    for i in range(0, len(docs), batch_size):
        chunk = docs[i : i + batch_size]
        ids, labels = collate(chunk, pid)
        ids, labels = ids.to(device), labels.to(device)
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, use_cache=False).logits
        pred = logits.argmax(-1)
        for b, d in enumerate(chunk):
            sl = slice(d.n_prompt - 1, len(d.ids) - 1)
            p, y = pred[b, sl].tolist(), labels[b, sl].tolist()
            ok = tuple(a == c for a, c in zip(p, y))
            out.append(DocResult(d.task, all(ok), len(ok), sum(ok), ok, tuple(p)))
    return out


def digit_accuracy(docs: list[Doc], results: list[DocResult]) -> float:
    """Share of answer digit tokens predicted correctly (nan when there are none)."""
    from flashmemory.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    digits = {tok.ids[c] for c in "0123456789"}
    n = k = 0
    for d, r in zip(docs, results):
        for tgt, ok in zip(d.ids[d.n_prompt :], r.correct):
            if tgt in digits:
                n += 1
                k += int(ok)
    return k / n if n else float("nan")


def summarize(results: list[DocResult]) -> dict[str, float]:
    """{'acc': exact-match share, 'tok_acc': answer-token share, 'acc/<task>': per task}."""
    if not results:
        return {}
    s = {
        "acc": sum(r.exact for r in results) / len(results),
        "tok_acc": sum(r.n_correct for r in results) / max(1, sum(r.n_tokens for r in results)),
    }
    for task in sorted({r.task for r in results}):
        rs = [r for r in results if r.task == task]
        s[f"acc/{task}"] = sum(r.exact for r in rs) / len(rs)
    return s
