"""The task registry: generate items of a given token length, score model outputs, write dump-input JSONL.

A JSONL line holds `prompt` (JSON-encoded OpenAI messages), `answer` (string), `answers` (list, for
scoring), `task`, `length` (the requested token budget), `n_tokens` (the rendered prompt's length with the
chosen tokenizer, always <= length), `depth` (requested; null for cwe/fwe), `needle_depth` (measured token
fraction), `seed`, `index`, `tokenizer`, `meta`, and `random_string_to_prepend` (MRCR prefix, else "") so
the dump client's messages path accepts the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from typing import Any

from flashmemory.tasks import mrcr, needles, words
from flashmemory.tasks.haystack import Built, fit_size
from flashmemory.tasks.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class TaskSpec:
    name: str
    default_count: int
    uses_depth: bool
    builder: Callable[..., Callable[[int], Built]]  # (seed, tok, depth, count, length) -> make(size)
    scorer: str  # "all" (fraction of answers found) or "mrcr"
    help: str


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in [
        TaskSpec(
            "niah_single",
            1,
            True,
            lambda s, tok, d, c, L: needles.niah_single(s, tok, d, c),
            "all",
            "one needle (key -> 7-digit number) in filler text",
        ),
        TaskSpec(
            "niah_multikey",
            4,
            True,
            lambda s, tok, d, c, L: needles.niah_multikey(s, tok, d, c),
            "all",
            "COUNT needles with different keys; one is asked",
        ),
        TaskSpec(
            "mqar",
            6,
            True,
            lambda s, tok, d, c, L: needles.niah_multiquery(s, tok, d, c),
            "all",
            "multi-query associative recall: COUNT needles, three of them asked at once",
        ),
        TaskSpec(
            "niah_multivalue",
            4,
            True,
            lambda s, tok, d, c, L: needles.niah_multivalue(s, tok, d, c),
            "all",
            "COUNT values under one key; all are asked",
        ),
        TaskSpec(
            "vt",
            5,
            True,
            lambda s, tok, d, c, L: needles.variable_tracking(s, tok, d, c),
            "all",
            "variable tracking: a chain of COUNT assignments plus a distractor chain",
        ),
        TaskSpec(
            "cwe",
            10,
            False,
            lambda s, tok, d, c, L: words.common_words(s, L, c),
            "all",
            "common-word extraction: the COUNT words repeated most in a numbered list",
        ),
        TaskSpec(
            "fwe",
            3,
            False,
            lambda s, tok, d, c, L: words.frequent_words(s, L, c),
            "all",
            "frequent-word extraction: the COUNT most frequent words of a Zipf text",
        ),
        TaskSpec(
            "mrcr",
            4,
            True,
            lambda s, tok, d, c, L: mrcr.mrcr(s, tok, d, c),
            "mrcr",
            "multi-round coreference: COUNT identical requests in a long chat; reproduce the n-th",
        ),
    ]
}


@dataclass(frozen=True)
class TaskItem:
    task: str
    messages: list[dict[str, str]]
    answers: list[str]
    length: int
    n_tokens: int
    depth: float | None
    needle_depth: float | None
    seed: int
    index: int
    tokenizer: str
    meta: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        rec = asdict(self)
        msgs = rec.pop("messages")
        answer = self.answers[0] if TASKS[self.task].scorer == "mrcr" else ", ".join(self.answers)
        return {
            "prompt": json.dumps(msgs, ensure_ascii=False),
            "answer": answer,
            **rec,
            "random_string_to_prepend": self.meta.get("prefix", ""),
        }


def default_depth(index: int, n: int) -> float:
    """Items sweep depth evenly over [0, 1] when no depth is given."""
    return 0.5 if n <= 1 else index / (n - 1)


def generate(
    task: str,
    length: int,
    n: int = 1,
    seed: int = 0,
    depth: float | None = None,
    count: int | None = None,
    tokenizer: Tokenizer | str | None = None,
) -> list[TaskItem]:
    """`n` items of `task`, each rendering to at most `length` tokens. Deterministic in (task, seed, index, args)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if length < 1 or n < 1:
        raise ValueError(f"length and n must be >= 1, got length={length}, n={n}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    spec = TASKS[task]
    tok = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else load_tokenizer(tokenizer)
    c = spec.default_count if count is None else count
    items = []
    for i in range(n):
        d = (default_depth(i, n) if depth is None else depth) if spec.uses_depth else None
        make = spec.builder(f"{task}:{seed}:{i}:{c}", tok, 0.5 if d is None else d, c, length)
        built, n_tok = fit_size(make, tok, length, 1, task)
        items.append(
            TaskItem(
                task, built.messages, built.answers, length, n_tok, d, built.needle_depth, seed, i, tok.name, built.meta
            )
        )
    return items


def _found(answer: str, text: str) -> bool:
    """Whole-word / whole-number, case-insensitive containment."""
    return re.search(rf"(?<![\w]){re.escape(answer.lower())}(?![\w])", text.lower()) is not None


def score(item: TaskItem | Mapping[str, Any], output: str) -> float:
    """Score one model output in [0, 1]: RULER string-match-all, or MRCR prefix + similarity ratio."""
    get = (lambda k: getattr(item, k)) if isinstance(item, TaskItem) else item.__getitem__
    task, answers = get("task"), list(get("answers"))
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} in item")
    if TASKS[task].scorer == "mrcr":
        meta = get("meta")
        prefix = meta["prefix"]
        out = output.strip()
        if not out.startswith(prefix):
            return 0.0
        return SequenceMatcher(None, out[len(prefix) :], answers[0][len(prefix) :], autojunk=False).ratio()
    if not answers:
        raise ValueError(f"item of task {task!r} has no answers")
    return sum(_found(a, output) for a in answers) / len(answers)


def write_jsonl(items: Iterable[TaskItem], path: str) -> int:
    """Atomically write items as dump-input JSONL; returns the number of lines."""
    from flashmemory.atomic import atomic_write_text

    lines = [json.dumps(it.to_record(), ensure_ascii=False) + "\n" for it in items]
    atomic_write_text(path, "".join(lines))
    return len(lines)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Read task JSONL back (for scoring); names the line of any malformed entry."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for ln, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                json.loads(rec["prompt"])
                rec["task"], rec["answers"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path} line {ln}: not a task record ({type(e).__name__}: {e})") from None
            out.append(rec)
    return out
