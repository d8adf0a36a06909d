"""Task generators: deterministic, fit the token budget, place needles at the stated depth, score correctly,
and reject bad arguments with clear errors."""

from __future__ import annotations

import json

import pytest

from flashmemory.tasks import TASKS, generate, load_tokenizer, read_jsonl, score, write_jsonl
from flashmemory.tasks.words import rare_counts, zipf_counts

L = 2048


@pytest.mark.parametrize("task", list(TASKS))
def test_deterministic_and_within_budget(task):
    a = generate(task, L, n=2, seed=7)
    b = generate(task, L, n=2, seed=7)
    c = generate(task, L, n=2, seed=8)
    assert [x.to_record() for x in a] == [x.to_record() for x in b]
    assert [x.messages for x in a] != [x.messages for x in c]
    tok = load_tokenizer()
    for it in a:
        assert it.n_tokens == len(tok.encode_chat(it.messages)) <= L
        assert it.n_tokens >= 0.9 * L, "prompt should be filled close to the budget"


def _find(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    return -1


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "vt"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.6, 1.0])
def test_needle_sits_at_the_stated_depth(task, depth):
    tok = load_tokenizer()
    it = generate(task, L, n=1, seed=1, depth=depth)[0]
    content = it.messages[0]["content"]
    intro, rest = content.split("\n", 1)
    context = rest.rsplit("\n", 1)[0]
    ctx_ids, needle_ids = tok.encode(context), tok.encode(it.meta["needle"])
    pos = _find(ctx_ids, needle_ids)
    assert pos >= 0, "needle text not found in the context"
    assert abs(pos / len(ctx_ids) - depth) < 0.03
    assert abs(it.needle_depth - pos / len(ctx_ids)) < 0.01


def test_mrcr_target_depth_and_answer():
    lo, hi = generate("mrcr", 4096, n=1, seed=2, depth=0.1)[0], generate("mrcr", 4096, n=1, seed=2, depth=0.9)[0]
    assert lo.needle_depth < 0.35 and hi.needle_depth > 0.65
    for it in (lo, hi):
        answer = it.answers[0]
        assert answer.startswith(it.meta["prefix"])
        reqs = [m["content"] for m in it.messages if m["role"] == "user"][:-1]
        resps = [m["content"] for m in it.messages if m["role"] == "assistant"]
        target = reqs[it.meta["target_turn"]]
        copies = [r for q, r in zip(reqs, resps) if q == target]
        assert len(copies) == 4 and copies[it.meta["nth"] - 1] == answer[len(it.meta["prefix"]) :]
        assert score(it, answer) == 1.0
        assert score(it, answer[len(it.meta["prefix"]) :]) == 0.0  # prefix missing
        wrong = [c for c in copies if c != copies[it.meta["nth"] - 1]][0]
        assert 0.0 < score(it, it.meta["prefix"] + wrong) < 1.0


def test_scorers_reward_only_the_answer():
    it = generate("niah_multivalue", L, n=1, seed=0, count=4)[0]
    assert score(it, " ".join(it.answers)) == 1.0
    assert score(it, ", ".join(it.answers[:2])) == 0.5
    assert score(it, "1" + it.answers[0]) == 0.0  # a longer number is not a match
    vt = generate("vt", L, n=1, seed=0)[0]
    assert score(vt, "the answer: " + ", ".join(vt.answers)) == 1.0
    assert score(vt, "none") == 0.0


def test_cwe_and_fwe_answers_are_the_most_frequent():
    for task, k, length in (("cwe", 10, L), ("fwe", 3, L), ("cwe", 10, 16384), ("fwe", 3, 16384)):
        it = generate(task, length, n=1, seed=4)[0]
        assert it.n_tokens >= 0.9 * length
        text = it.messages[0]["content"].split("\n", 1)[1].rsplit("\n", 1)[0]
        words = [w.strip(".") for line in text.split("\n") for w in line.split() if not w[:-1].isdigit()]
        counts: dict[str, int] = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        ranked = sorted(counts, key=counts.get, reverse=True)
        assert set(ranked[:k]) == set(it.answers)
        assert counts[ranked[k - 1]] > counts[ranked[k]], "the answer must be unique"
        assert score(it, "\n".join(it.answers)) == 1.0


def test_zipf_counts_strictly_decreasing_at_top():
    c = zipf_counts(30, 40, 3)
    assert c[0] > c[1] > c[2] > c[3] and min(c) >= 1


def test_rare_counts_fill_then_spread_under_the_cap():
    assert rare_counts(4, 7, 10) == [3, 3, 1, 0]
    assert rare_counts(4, 14, 10) == [4, 4, 3, 3]
    assert rare_counts(4, 1000, 10) == [10, 10, 10, 10]


def test_bad_arguments_have_clear_errors():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        generate("nope", L)
    with pytest.raises(ValueError, match="depth must lie in"):
        generate("niah_single", L, depth=1.2)
    with pytest.raises(ValueError, match="depth must lie in"):
        generate("niah_single", L, depth=-0.1)
    with pytest.raises(ValueError, match="too short for task 'niah_multikey'"):
        generate("niah_multikey", 200, count=8)
    with pytest.raises(ValueError, match="exactly one needle"):
        generate("niah_single", L, count=2)
    with pytest.raises(ValueError, match="count >= 2"):
        generate("niah_multivalue", L, count=1)
    with pytest.raises(ValueError, match="mrcr needs"):
        generate("mrcr", L, count=9)
    with pytest.raises(ValueError, match="length and n"):
        generate("cwe", 0)


def test_jsonl_round_trip_in_dump_format(tmp_path):
    items = generate("mrcr", 1024, n=2, seed=0) + generate("niah_single", 1024, n=1, seed=0)
    path = tmp_path / "t.jsonl"
    assert write_jsonl(items, str(path)) == 3
    recs = read_jsonl(str(path))
    for it, rec in zip(items, recs):
        assert json.loads(rec["prompt"]) == it.messages
        assert {"answer", "task", "length", "depth", "random_string_to_prepend"} <= set(rec)
        assert score(rec, rec["answer"]) == 1.0
    assert recs[0]["random_string_to_prepend"] == items[0].meta["prefix"]
    assert recs[2]["random_string_to_prepend"] == ""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match="line 4"):
        read_jsonl(str(bad))
