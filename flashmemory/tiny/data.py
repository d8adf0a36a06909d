"""Curriculum documents for the tiny retrieval model, built from the task suite's own generators.

A `Doc` is one chat prompt (tiny word-level tokenizer, `<bos> <|user|> ... <|end|> <|assistant|>`) followed
by its answer tokens and `<|end|>`. Answers are the suite's: the number (mqar: the asked
numbers, comma-separated, in the asked order), vt: the chain's names, mrcr: prefix + the copied response.
The loss and the accuracy are on the answer tokens only. Every document
fits `length` tokens; batches are right-padded (pads sit after every scored token, so they change nothing
a causal model scores).

`spans` locate the answer's evidence in the prompt: for each answer, the token spans [start, end) where
its tokens occur in the context (niah/mqar: the needle's number; vt: `variable NAME` occurrences; mrcr:
the copied response). `owner[i]` says which answer target token i belongs to (-1: separators, the MRCR
prefix, the final `<|end|>`), so per-step evidence is `spans[owner[i]]`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from flashmemory.tasks.suite import TASKS
from flashmemory.tasks.tokenizer import TinyTokenizer, load_tokenizer

# (task, weight, counts drawn uniformly) of the training mix.
MIX: tuple[tuple[str, float, tuple[int, ...]], ...] = (
    ("niah_single", 0.15, (1,)),
    ("niah_multikey", 0.30, (2, 3, 4, 6, 8)),
    ("mqar", 0.25, (3, 4, 6, 8)),
    ("vt", 0.15, (2, 3, 4, 5)),
    ("mrcr", 0.15, (2, 3, 4)),
)
NEEDLE_TASKS = ("niah_single", "niah_multikey", "mqar")


@dataclass(frozen=True)
class Doc:
    task: str
    ids: list[int]  # prompt + answer + <|end|>
    n_prompt: int  # answer token i sits at position n_prompt + i
    answers: list[str]
    owner: list[int]  # per target token: answer index, or -1
    spans: list[list[tuple[int, int]]]  # per answer: evidence token spans [start, end) in the prompt
    depth: float
    count: int

    @property
    def n_target(self) -> int:
        return len(self.ids) - self.n_prompt


def _find(seq: list[int], pat: list[int], stop: int) -> list[tuple[int, int]]:
    """All [start, end) occurrences of `pat` in seq[:stop]."""
    n = len(pat)
    if n == 0:
        return []
    first = pat[0]
    return [(i, i + n) for i in range(0, stop - n + 1) if seq[i] == first and seq[i : i + n] == pat]


def _targets(task: str, answers: list[str], meta: dict, tok: TinyTokenizer) -> tuple[list[int], list[int]]:
    """Answer token ids (ending with <|end|>) and their owners."""
    end = tok.ids["<|end|>"]
    if task == "mrcr":
        pre, body = tok.encode(meta["prefix"]), tok.encode(meta["needle"])
        return pre + body + [end], [-1] * len(pre) + [0] * len(body) + [-1]
    ids: list[int] = []
    owner: list[int] = []
    comma = tok.encode(",")
    for k, a in enumerate(answers):
        if k:
            ids += comma
            owner += [-1] * len(comma)
        t = tok.encode(a)
        ids += t
        owner += [k] * len(t)
    return ids + [end], owner + [-1]


def _spans(
    task: str, prompt: list[int], answers: list[str], meta: dict, tok: TinyTokenizer, context_end: int
) -> list[list[tuple[int, int]]]:
    if task == "mrcr":
        return [_find(prompt, tok.encode(meta["needle"]), context_end)]
    if task == "vt":
        var = tok.encode("variable")
        return [_find(prompt, var + tok.encode(a), context_end) for a in answers]
    return [_find(prompt, tok.encode(a), context_end) for a in answers]


def make_doc(
    task: str,
    length: int,
    seed: str,
    count: int | None = None,
    depth: float | None = None,
    tok: TinyTokenizer | None = None,
) -> Doc:
    """One document of `task` with at most `length` tokens (prompt + answer), deterministic in its arguments.

    The filler size is guessed, then shrunk until the whole document fits (one encode per try), which
    is much cheaper than the suite's exact binary search. Raises ValueError if even one filler unit is
    too long (e.g. mrcr at 128 tokens).
    """
    tok = tok or load_tokenizer(None)
    spec = TASKS[task]
    rng = random.Random(seed + ":doc")
    c = spec.default_count if count is None else count
    d = rng.random() if depth is None else depth
    make = spec.builder(seed, tok, d, c, length)
    per_unit = 60 if task == "mrcr" else 11
    size = max(1, length // per_unit)
    for _ in range(40):
        built = make(size)
        prompt = tok.encode_chat(built.messages)
        tgt, owner = _targets(task, built.answers, built.meta, tok)
        n = len(prompt) + len(tgt)
        if n <= length:
            # evidence is searched in the context only: before the question (mrcr: before the last user turn)
            last_user = max(i for i, t in enumerate(prompt) if t == tok.ids["<|user|>"])
            ctx_end = last_user if task == "mrcr" else _question_start(prompt, tok)
            spans = _spans(task, prompt, built.answers, built.meta, tok, ctx_end)
            return Doc(task, prompt + tgt, len(prompt), list(built.answers), owner, spans, d, c)
        if size == 1:
            break
        size = max(1, min(size - 1, int(size * length / n * 0.98)))
    raise ValueError(f"task {task!r} (count {c}) does not fit {length} tokens")


def _question_start(prompt: list[int], tok: TinyTokenizer) -> int:
    """Token index where the final question line starts (after the last newline of the user message)."""
    nl = tok.ids["<nl>"]
    idx = [i for i, t in enumerate(prompt) if t == nl]
    return idx[-1] if idx else len(prompt)


def sample_doc(length: int, seed: str, mix=MIX, tok: TinyTokenizer | None = None) -> Doc:
    """A document from the weighted task mix; tasks that cannot fit `length` are redrawn."""
    rng = random.Random(seed + ":mix")
    tasks = [m for m in mix]
    for attempt in range(10):
        task, _, counts = rng.choices(tasks, weights=[m[1] for m in tasks])[0]
        try:
            return make_doc(task, length, f"{seed}:{attempt}", rng.choice(counts), None, tok)
        except ValueError:
            tasks = [m for m in tasks if m[0] != task] or list(mix)
    raise ValueError(f"no task of the mix fits {length} tokens")


def collate(docs: list[Doc], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, L], labels [B, L]) with labels[b, t] = the token at t + 1 when it is an answer token,
    else -100; L = the longest document (right-padded with pad_id)."""
    n = max(len(d.ids) for d in docs)
    ids = torch.full((len(docs), n), pad_id, dtype=torch.long)
    labels = torch.full((len(docs), n), -100, dtype=torch.long)
    for b, d in enumerate(docs):
        ids[b, : len(d.ids)] = torch.tensor(d.ids)
        labels[b, d.n_prompt - 1 : len(d.ids) - 1] = torch.tensor(d.ids[d.n_prompt :])
    return ids, labels


def heldout_docs(
    task: str,
    n: int,
    length: int,
    seed: int = 0,
    count: int | None = None,
    depth_range: tuple[float, float] = (0.0, 0.9),
) -> list[Doc]:
    """`n` held-out documents (seed namespace `heldout:`, never drawn in training; training seeds are
    `train:`), depths spread evenly over `depth_range` so the evidence sits beyond the window."""
    lo, hi = depth_range
    return [
        make_doc(task, length, f"heldout:{seed}:{task}:{i}", count, lo + (hi - lo) * (i / max(n - 1, 1)))
        for i in range(n)
    ]


def heldout_mix(
    length: int, n_per_task: int, seed: int = 0, tasks: tuple[str, ...] = tuple(m[0] for m in MIX)
) -> list[Doc]:
    """`heldout_docs` for every task of `tasks` that fits `length` (tasks that cannot fit are skipped)."""
    out: list[Doc] = []
    for t in tasks:
        try:
            out += heldout_docs(t, n_per_task, length, seed)
        except ValueError:
            continue
    return out
