"""`eval.live.run`: records per (arm, document), resume, chunks, fingerprints by content, the lock hand-back."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flashmemory.errors import UserError
from flashmemory.eval.live.run import (
    counter_delta,
    decode_ids,
    make_doc,
    plan,
    record_fingerprint,
    record_path,
    run_live,
)
from flashmemory.tasks.tokenizer import load_tokenizer
from tests.eval.live.conftest import FakeOpener, small_config


def answer_table(cfg):
    """answers(arm, prompt, n): the document's answer for stock, the same but for mqar under FlashMemory."""
    tok = load_tokenizer("tiny")
    docs = {d.prompt: d for d in (make_doc(cfg, i, t, tok) for i, t in plan(cfg))}

    def answers(arm, prompt, n):
        d = docs[prompt]
        good = tok.encode(", ".join(d.item.answers))
        out = good if arm.kind == "stock" or d.task != "mqar" else tok.encode("no idea")
        return list(d.prompt_ids), (out + [tok.unk] * n)[:n]

    return answers


def test_records_per_arm_and_document_and_scores(tmp_path, model_dir, retriever):
    cfg = small_config(tmp_path / "out", model_dir, retriever, gen_tokens=40)
    opener = FakeOpener(answer_table(cfg))
    done = run_live(cfg, opener, log=lambda *a: None)
    assert sorted(done) == ["FlashMemory@0.1", "stock"]
    assert sorted(done["stock"]) == [8, 9, 10, 11]
    for arm in cfg.arms:
        for i in done[arm.key]:
            rec = json.loads(record_path(tmp_path / "out", arm, i).read_text())
            assert rec["prompt_ids_equal"] and len(rec["output_ids"]) == 40
            assert rec["metrics"]["flashmemory_recall_bytes_total"] == 4096.0  # a delta per document
            assert rec["metrics"]["flashmemory_resident_fraction"] == 0.125  # a gauge as read
    assert all(r["task_score"] == 1.0 for r in done["stock"].values())
    fm = {i: r["task_score"] for i, r in done["FlashMemory@0.1"].items()}
    assert fm[9] < 1.0 and fm[11] < 1.0 and fm[8] == fm[10] == 1.0  # 9, 11: mqar (i % 2 == 1)
    assert all(s.closed for s in opener.sessions) and len(opener.sessions) == 2
    assert (tmp_path / "out" / "live.md").is_file() and (tmp_path / "out" / "live.json").is_file()


def test_rerun_skips_done_documents_and_chunks_resume(tmp_path, model_dir, retriever):
    cfg = small_config(tmp_path / "out", model_dir, retriever, max_docs=1)
    first = FakeOpener(answer_table(cfg))
    run_live(cfg, first, log=lambda *a: None)
    assert len(first.requests) == 2  # one document per arm
    second = FakeOpener(answer_table(cfg))
    run_live(replace(cfg, max_docs=None), second, log=lambda *a: None)
    assert len(second.requests) == 6 and not {p for _, p in first.requests} & {
        p for a, p in second.requests if a == "stock"
    }
    third = FakeOpener(answer_table(cfg))
    done = run_live(replace(cfg, max_docs=None), third, log=lambda *a: None)
    assert third.sessions == [] and all(len(v) == 4 for v in done.values())  # nothing started when all is done


def test_torn_record_is_redone_alone(tmp_path, model_dir, retriever):
    cfg = small_config(tmp_path / "out", model_dir, retriever)
    run_live(cfg, FakeOpener(answer_table(cfg)), log=lambda *a: None)
    torn = record_path(tmp_path / "out", cfg.arms[1], 10)
    torn.write_text('{"format": "flashmemory-live/1", "finger')
    again = FakeOpener(answer_table(cfg))
    run_live(cfg, again, log=lambda *a: None)
    assert [a for a, _ in again.requests] == ["FlashMemory@0.1"]
    assert json.loads(torn.read_text())["index"] == 10


@pytest.mark.parametrize("change", ["server_env", "weights", "gen_tokens"])
def test_record_of_another_configuration_is_refused_naming_the_file(tmp_path, model_dir, retriever, change):
    cfg = small_config(tmp_path / "out", model_dir, retriever, arms=small_config(tmp_path, model_dir, "").arms[:1])
    run_live(cfg, FakeOpener(answer_table(cfg)), log=lambda *a: None)
    if change == "server_env":
        cfg = replace(cfg, server_env=(("SGLANG_X", "1"),))
    elif change == "weights":
        (model_dir / "model.safetensors").write_bytes(b"weights-v2")
    else:
        cfg = replace(cfg, gen_tokens=7)
    with pytest.raises(UserError, match=r"docs/stock/00008\.json: written with another configuration"):
        run_live(cfg, FakeOpener(answer_table(cfg)), log=lambda *a: None)


def test_fingerprint_keys_on_document_content():
    s = {"arm": "stock", "model": "m"}
    assert record_fingerprint(s, "a" * 64) != record_fingerprint(s, "b" * 64)
    assert record_fingerprint(s, "a" * 64) == record_fingerprint(dict(s), "a" * 64)


def test_another_commands_record_is_refused(tmp_path, model_dir, retriever):
    cfg = small_config(tmp_path / "out", model_dir, retriever)
    p = record_path(tmp_path / "out", cfg.arms[0], 8)
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"format": "flashmemory-frontier/1"}))
    with pytest.raises(UserError, match="not a record of `flashmemory eval live`"):
        run_live(cfg, FakeOpener(answer_table(cfg)), log=lambda *a: None)


def test_lock_is_handed_back_after_hold_s(tmp_path, model_dir, retriever):
    cfg = small_config(tmp_path / "out", model_dir, retriever, arms=small_config(tmp_path, model_dir, "").arms[:1])
    opener = FakeOpener(answer_table(cfg))
    run_live(replace(cfg, hold_s=1.5), opener, log=lambda *a: None)  # a document: 1 s of the session clock
    assert [len(s.log) for s in opener.sessions] == [2, 2] and all(s.closed for s in opener.sessions)


def test_flashmemory_arm_needs_a_retriever(tmp_path, model_dir):
    cfg = small_config(tmp_path / "out", model_dir, "")
    with pytest.raises(UserError, match="--retriever"):
        run_live(cfg, FakeOpener(answer_table(cfg)), log=lambda *a: None)


def test_counter_delta_and_decode_of_parked_ids():
    d = counter_delta({"a_total": 5.0, "g": 3.0}, {"a_total": 9.0, "g": 0.5, "b_total": 2.0})
    assert d == {"a_total": 4.0, "g": 0.5, "b_total": 2.0}
    tok = load_tokenizer("tiny")
    assert decode_ids(tok, [tok.ids["the"], 830, tok.vocab_size + 5]) == "the <unk> <unk>"
