"""An MRCR-like multi-round coreference task: a long chat in which the user asks for pieces of writing
("write a poem about otters"); `count` of those requests are identical. The last turn asks the model to
prepend a random string to the n-th of them. Scored like OpenAI MRCR: 0 unless the output starts with the
string, else the similarity ratio of the rest to the expected response. The n-th copy sits at `depth`
(turn granularity; its measured token depth is reported)."""

from __future__ import annotations

import random

from flashmemory.tasks.haystack import ADJS, NOUNS, ORDINALS, Built, sentence
from flashmemory.tasks.tokenizer import Tokenizer

KINDS = ["poem", "story", "song", "riddle", "letter", "essay", "joke"]


def _response(rng: random.Random, kind: str, topic: str) -> str:
    verb = rng.choice(["sang", "walked", "slept", "waited"])
    lines = [
        f"here is a {kind} about the {topic}.",
        f"the {rng.choice(ADJS)} {topic} {verb} near the {rng.choice(NOUNS)}.",
    ]
    lines += [sentence(rng) for _ in range(rng.randrange(2, 6))]
    return "\n".join(lines)


def mrcr(seed: str, tok: Tokenizer, depth: float, count: int):
    if not 2 <= count <= len(ORDINALS):
        raise ValueError(f"mrcr needs 2 <= count <= {len(ORDINALS)} identical requests, got {count}")
    rng = random.Random(seed)
    kind, topic = rng.choice(KINDS), rng.choice(NOUNS)
    nth = rng.randrange(1, count + 1)
    prefix = "".join(rng.choice("0123456789") for _ in range(10))
    target_req = f"write a {kind} about the {topic}."
    copies = [_response(random.Random(f"{seed}:copy{i}"), kind, topic) for i in range(count)]
    stream_rng = random.Random(seed + ":turns")
    fillers: list[tuple[str, str]] = []

    def filler(i: int) -> tuple[str, str]:
        while len(fillers) <= i:
            # near-identical distractors: same kind or same topic, never both
            if stream_rng.random() < 0.5:
                k, t = kind, stream_rng.choice([n for n in NOUNS if n != topic])
            else:
                k, t = stream_rng.choice([x for x in KINDS if x != kind]), topic
            fillers.append((f"write a {k} about the {t}.", _response(stream_rng, k, t)))
        return fillers[i]

    question = (
        f"prepend {prefix} to the {ORDINALS[nth - 1]} {kind} about the {topic}. "
        f"do not include any other text in your response."
    )

    def make(size: int) -> Built:
        turns = size + count
        # place the n-th copy at `depth`, leaving room for the copies before and after it
        t_pos = min(max(round(depth * (turns - 1)), nth - 1), turns - 1 - (count - nth))
        r = random.Random(f"{seed}:{size}")
        before = sorted(r.sample(range(t_pos), nth - 1))
        after = sorted(r.sample(range(t_pos + 1, turns), count - nth))
        slots = {p: c for c, p in enumerate(before + [t_pos] + after)}
        msgs, chars, fi, target_at = [], 0, 0, 0
        for t in range(turns):
            if t in slots:
                req, resp = target_req, copies[slots[t]]
            else:
                req, resp = filler(fi)
                fi += 1
            if t == t_pos:
                target_at = chars + len(req)
            msgs += [{"role": "user", "content": req}, {"role": "assistant", "content": resp}]
            chars += len(req) + len(resp)
        msgs.append({"role": "user", "content": question})
        answer = prefix + copies[nth - 1]
        history = "".join(m["content"] for m in msgs[:-1])
        depth_m = len(tok.encode(history[:target_at])) / max(1, len(tok.encode(history)))
        return Built(
            msgs,
            [answer],
            depth_m,
            {
                "prefix": prefix,
                "nth": nth,
                "turns": turns,
                "target_turn": t_pos,
                "target_char": target_at,
                "needle": copies[nth - 1],
            },
        )

    return make
