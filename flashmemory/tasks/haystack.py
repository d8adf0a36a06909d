"""Shared pieces of every task: in-vocabulary word pools, a deterministic filler-sentence stream, needle
placement by token depth, and fitting a prompt to a token budget.

Every generator draws from `random.Random(str)` seeds (stable across runs and PYTHONHASHSEED) and builds
its prompt as `make(size)`: a function of one size knob (filler units) that is cheap to re-run, so the
largest size whose rendered prompt fits `length` tokens is found by binary search (`fit_size`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashmemory.tasks.tokenizer import Tokenizer

NOUNS = """apple river mountain forest garden window door table chair book paper pencil lamp candle stone rock sand
ocean lake island valley bridge road street city town village house castle tower wall roof floor kitchen bread
cheese butter honey milk water coffee tea sugar salt pepper rice corn wheat bean carrot potato onion lemon orange
grape cherry peach plum melon berry flower tree leaf branch root seed grass moss fern rose tulip daisy lily moon
star sky cloud rain snow wind storm thunder shadow fire smoke ice frost fog dog cat horse cow sheep goat pig rabbit
mouse bird eagle owl crow duck goose swan fish whale shark dolphin turtle frog snake lizard bee ant spider
butterfly moth tiger lion bear wolf fox deer elephant giraffe zebra monkey camel tapir otter badger beaver penguin
parrot falcon hawk raven king queen prince princess knight soldier farmer baker teacher doctor sailor pilot
painter singer writer student child mother father brother sister friend stranger neighbor traveler merchant
hunter fisher miller ship boat train car wagon wheel engine clock watch mirror bell drum flute violin piano guitar
map compass coin ring crown sword shield bow arrow hammer nail rope box basket bottle cup plate bowl spoon knife
fork pot kettle oven stove bed blanket pillow coat hat shoe boot glove scarf shirt dress button needle thread
cloth silk wool cotton leather gold copper iron steel glass clay wood marble paint ink game puzzle treasure
journey voyage adventure dream memory idea plan reason problem lesson school library museum market shop harbor
station field meadow hill cliff cave desert jungle swamp canyon shore coast planet comet galaxy robot machine
computer phone camera radio telescope lantern ladder fence gate path tunnel""".split()
ADJS = """red blue green yellow purple pink brown black white gray golden bright dark quiet loud soft hard warm cold
hot cool wet dry big small tall short wide narrow heavy fast slow young ancient happy sad calm wild gentle brave
clever kind proud shy lazy busy rich poor clean dirty fresh sweet bitter sour salty smooth rough sharp round square
empty full strange lucky shiny dusty frozen sleepy hungry curious famous humble noble silent eager patient honest
fierce graceful tiny huge distant nearby simple""".split()
PAST = (
    "walked ran sang saw looked found kept held carried gave took made built opened closed watched waited moved "
    "rested slept danced painted cooked grew flew swam climbed followed visited brought sat stood played spoke "
    "heard knew thought felt shone fell rose turned went came said told left stayed showed".split()
)
PRES = (
    "walks runs sings sees looks finds keeps holds carries gives takes makes builds opens closes watches waits "
    "moves rests sleeps dances paints cooks grows flies swims climbs follows visits brings sits stands plays "
    "speaks hears knows thinks feels shines falls rises turns goes comes says tells leaves stays shows".split()
)
PREPS = "near under over through above below into from".split()
TIMES = [
    "every morning",
    "every evening",
    "each spring",
    "each winter",
    "in the summer",
    "in the autumn",
    "at night",
    "once a week",
]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]


def sentence(rng: random.Random) -> str:
    """One filler sentence, lowercase and in-vocabulary."""
    n, a, p = rng.choice, rng.choice, rng.choice
    form = rng.randrange(4)
    if form == 0:
        return f"the {a(ADJS)} {n(NOUNS)} {p(PAST)} {p(PREPS)} the {n(NOUNS)}."
    if form == 1:
        return f"a {n(NOUNS)} and a {n(NOUNS)} {p(PAST)} near the {a(ADJS)} {n(NOUNS)}."
    if form == 2:
        return f"{p(TIMES)} the {n(NOUNS)} {p(PRES)} {p(PREPS)} the {a(ADJS)} {n(NOUNS)}."
    return f"there was a {a(ADJS)} {n(NOUNS)} in the {n(NOUNS)}, and it {p(PAST)} again."


class SentenceStream:
    """A prefix-stable stream of filler sentences with their token counts (each counted with a leading space)."""

    def __init__(self, seed: str, tok: Tokenizer):
        self.rng = random.Random(seed)
        self.tok = tok
        self.items: list[tuple[str, int]] = []

    def take(self, n: int) -> list[tuple[str, int]]:
        while len(self.items) < n:
            s = sentence(self.rng)
            self.items.append((s, len(self.tok.encode(" " + s))))
        return self.items[:n]


def number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def distinct_keys(rng: random.Random, k: int) -> list[str]:
    """k distinct two-word keys `adjective noun`."""
    if k > len(ADJS) * len(NOUNS):
        raise ValueError(f"cannot draw {k} distinct keys")
    seen: list[str] = []
    while len(seen) < k:
        key = f"{rng.choice(ADJS)} {rng.choice(NOUNS)}"
        if key not in seen:
            seen.append(key)
    return seen


def insert_at_depths(units: list[tuple[str, int]], needles: list[tuple[float, str]]) -> tuple[str, list[int]]:
    """Join filler units with spaces, inserting each needle before the unit where the token fraction of the
    filler reaches its depth. Returns the text and each needle's character offset (input order)."""
    total = sum(c for _, c in units)
    cum, before = [0], 0
    for _, c in units:
        before += c
        cum.append(before)
    slots: dict[int, list[int]] = {}
    for i, (d, _) in enumerate(needles):
        j = min(range(len(cum)), key=lambda k: abs(cum[k] - d * total)) if total else 0
        slots.setdefault(j, []).append(i)
    parts, offsets, pos = [], [0] * len(needles), 0
    for j in range(len(units) + 1):
        for i in slots.get(j, []):
            offsets[i] = pos + (1 if parts else 0)
            parts.append(needles[i][1])
            pos = offsets[i] + len(needles[i][1])
        if j < len(units):
            pos += (1 if parts else 0) + len(units[j][0])
            parts.append(units[j][0])
    return " ".join(parts), offsets


def token_fraction(tok: Tokenizer, text: str, start: int, end: int, at: int) -> float:
    """Token position of character `at` within text[start:end], as a fraction of that span's tokens."""
    span = len(tok.encode(text[start:end]))
    return len(tok.encode(text[start:at])) / span if span else 0.0


@dataclass(frozen=True)
class Built:
    """One rendered prompt: OpenAI messages, expected answers, the needle's measured depth, extra metadata."""

    messages: list[dict[str, str]]
    answers: list[str]
    needle_depth: float | None
    meta: dict[str, Any]


def fit_size(make: Callable[[int], Built], tok: Tokenizer, length: int, lo: int, task: str) -> tuple[Built, int]:
    """Largest size >= lo whose prompt fits `length` tokens. make(size) must be deterministic and (roughly)
    grow with size; a size that stops growing the prompt ends the search (the task's pool is exhausted)."""

    def count(b: Built) -> int:
        return len(tok.encode_chat(b.messages))

    best = make(lo)
    n_lo = n_first = count(best)
    first = lo
    if n_lo > length:
        raise ValueError(
            f"length {length} is too short for task {task!r} with these arguments: the smallest "
            f"prompt (question, needles, {lo} filler unit(s)) already takes {n_lo} tokens"
        )
    hi, stalls = lo + 1, 0
    while True:  # jump ahead by the measured tokens per unit (+5%) until the prompt no longer fits
        b = make(hi)
        n = count(b)
        if n > length:
            break
        if n <= n_lo:  # a plateau (rounding) or an exhausted pool: gallop, give up after 16 doublings
            stalls += 1
            if stalls > 16:
                return best, n_lo
            hi *= 2
            continue
        best, n_lo, lo, stalls = b, n, hi, 0
        per_unit = max((n - n_first) / (hi - first), 1e-9)
        hi += max(1, int((length - n) / per_unit * 1.05) + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        b = make(mid)
        n = count(b)
        if n <= length:
            best, n_lo, lo = b, n, mid
        else:
            hi = mid
    return best, n_lo
