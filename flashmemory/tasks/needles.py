"""RULER-style retrieval tasks over a filler haystack: needle-in-a-haystack (single, multikey, multivalue)
and variable tracking. `count` is: multikey = needles in the text (1 queried + distractors), multivalue =
values stored under the queried key, vt = variables in the queried chain (a distractor chain of the same
length holds another value). The queried needle (vt: the chain's first assignment) sits at `depth`."""

from __future__ import annotations

import random

from flashmemory.tasks.haystack import (
    NOUNS,
    Built,
    SentenceStream,
    distinct_keys,
    insert_at_depths,
    number,
    token_fraction,
)
from flashmemory.tasks.tokenizer import Tokenizer

INTRO = (
    "some special magic numbers are hidden inside the following text. memorize them. i will quiz you "
    "about the numbers later."
)
VT_INTRO = "memorize and track the chain of variable assignments hidden in the following text."


def _needle(key: str, value: str) -> str:
    return f"one of the special magic numbers for {key} is: {value}."


def _render(intro: str, context: str, question: str) -> tuple[list[dict[str, str]], int, int]:
    """User message `intro\\n context \\n question`; returns messages and the context's char span in it."""
    start = len(intro) + 1
    content = f"{intro}\n{context}\n{question}"
    return [{"role": "user", "content": content}], start, start + len(context)


def _built(tok: Tokenizer, units, needles, intro, question, answers, meta) -> Built:
    context, offs = insert_at_depths(units, needles)
    msgs, s, e = _render(intro, context, question)
    depth = token_fraction(tok, msgs[0]["content"], s, e, s + offs[0])
    return Built(msgs, answers, depth, {**meta, "needle": needles[0][1]})


def niah_single(seed: str, tok: Tokenizer, depth: float, count: int):
    if count != 1:
        raise ValueError(f"niah_single takes exactly one needle, got count={count} (use niah_multikey)")
    rng = random.Random(seed)
    key, value = distinct_keys(rng, 1)[0], number(rng)
    question = f"what is the special magic number for {key} mentioned in the text above?"
    stream = SentenceStream(seed + ":filler", tok)

    def make(size: int) -> Built:
        return _built(tok, stream.take(size), [(depth, _needle(key, value))], INTRO, question, [value], {"key": key})

    return make


def niah_multikey(seed: str, tok: Tokenizer, depth: float, count: int):
    if count < 2:
        raise ValueError(f"niah_multikey needs count >= 2 needles (1 queried + distractors), got {count}")
    rng = random.Random(seed)
    keys = distinct_keys(rng, count)
    values = [number(rng) for _ in keys]
    needles = [(depth, _needle(keys[0], values[0]))] + [
        (rng.random(), _needle(k, v)) for k, v in zip(keys[1:], values[1:])
    ]
    question = f"what is the special magic number for {keys[0]} mentioned in the text above?"
    stream = SentenceStream(seed + ":filler", tok)

    def make(size: int) -> Built:
        return _built(tok, stream.take(size), needles, INTRO, question, [values[0]], {"key": keys[0]})

    return make


def niah_multiquery(seed: str, tok: Tokenizer, depth: float, count: int):
    """Multi-query associative recall: COUNT key -> number needles; min(3, COUNT) of them are asked, in one
    question, and every asked number must be given (in the asked order). The first asked needle sits at `depth`."""
    if count < 2:
        raise ValueError(f"mqar needs count >= 2 needles, got {count}")
    rng = random.Random(seed)
    keys = distinct_keys(rng, count)
    values: list[str] = []
    while len(values) < count:
        v = number(rng)
        if v not in values:
            values.append(v)
    needles = [(depth, _needle(keys[0], values[0]))] + [
        (rng.random(), _needle(k, v)) for k, v in zip(keys[1:], values[1:])
    ]
    asked = [0] + rng.sample(range(1, count), min(3, count) - 1)
    names = [keys[i] for i in asked]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    question = f"what are the special magic numbers for {listed} mentioned in the text above?"
    stream = SentenceStream(seed + ":filler", tok)

    def make(size: int) -> Built:
        return _built(tok, stream.take(size), needles, INTRO, question, [values[i] for i in asked], {"keys": names})

    return make


def niah_multivalue(seed: str, tok: Tokenizer, depth: float, count: int):
    if count < 2:
        raise ValueError(f"niah_multivalue needs count >= 2 values, got {count}")
    rng = random.Random(seed)
    key = distinct_keys(rng, 1)[0]
    values: list[str] = []
    while len(values) < count:
        v = number(rng)
        if v not in values:
            values.append(v)
    needles = [(depth, _needle(key, values[0]))] + [(rng.random(), _needle(key, v)) for v in values[1:]]
    question = f"what are all the special magic numbers for {key} mentioned in the text above?"
    stream = SentenceStream(seed + ":filler", tok)

    def make(size: int) -> Built:
        return _built(tok, stream.take(size), needles, INTRO, question, list(values), {"key": key})

    return make


def variable_tracking(seed: str, tok: Tokenizer, depth: float, count: int):
    if count < 2:
        raise ValueError(f"vt needs a chain of count >= 2 variables, got {count}")
    if 2 * count > len(NOUNS):
        raise ValueError(f"vt count={count} exceeds the {len(NOUNS) // 2} variable names available")
    rng = random.Random(seed)
    names = rng.sample(NOUNS, 2 * count)
    chain, other = names[:count], names[count:]
    value, other_value = number(rng, 5), number(rng, 5)
    while other_value == value:
        other_value = number(rng, 5)

    def links(vs: list[str], val: str) -> list[str]:
        return [f"variable {vs[0]} = {val}."] + [f"variable {b} = variable {a}." for a, b in zip(vs, vs[1:])]

    # The queried chain runs from `depth` towards the end in order; the distractor chain is scattered in order.
    needles = [(depth + (1 - depth) * i / count, s) for i, s in enumerate(links(chain, value))]
    needles += [(d, s) for d, s in zip(sorted(rng.random() for _ in other), links(other, other_value))]
    question = f"find all variables that are assigned the value {value} in the text above."
    stream = SentenceStream(seed + ":filler", tok)

    def make(size: int) -> Built:
        return _built(tok, stream.take(size), needles, VT_INTRO, question, list(chain), {"value": value})

    return make
