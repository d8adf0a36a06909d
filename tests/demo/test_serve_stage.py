"""The demo's serving stage (stage 7) without servers: prompts, the served retriever's choice, the live row and its
note, the preflight check, and a failed stage reported instead of raised. The live run itself is `make demo`."""

import subprocess
import sys
from pathlib import Path

import pytest

from flashmemory.demo import serve_stage as ss
from flashmemory.demo.serve_stage import chat_prompts, choose_retriever, live_note, live_table, same_model

SERVING = {
    "model": "/x/checkpoints/tiny-dsv4-sglang",
    "kmax": 2,
    "retriever_note": "a retriever trained here",
    "requests": [
        {"latency_s": 2.0, "prompt_tokens": 100, "completion_tokens": 8},
        {"latency_s": 4.0, "prompt_tokens": 300, "completion_tokens": 8},
    ],
    "resident_samples": [0.0, 0.2, 0.3],
    "metrics": {
        "flashmemory_resident_fraction": 0.125,
        "flashmemory_recall_bytes_total": 4096.0,
        "flashmemory_recall_pages_total": 5.0,
        "flashmemory_warm_start_pages_total": 2.0,
        "flashmemory_level1_cycles_total": 3.0,
    },
}


def test_chat_prompts_keep_roles_and_cut_content():
    msgs = [[{"role": "system", "content": "s" * 10}, {"role": "user", "content": "x" * 50 + "END"}]]
    out = chat_prompts(msgs, 8)
    assert out == [[{"role": "system", "content": "s" * 8}, {"role": "user", "content": "x" * 5 + "END"}]]


def test_live_table_reports_requests_and_counters():
    head, _, row = live_table(SERVING).splitlines()
    assert "of them at admission" in head and "L1 cycles" in head
    # resident frac: the mean of the positive samples taken while requests ran (0.25), not the final gauge
    assert row == "| FlashMemory (KMAX 2 pages) | 2 | 200 | 3.0 | 16 | 0.250 | 4 | 5 | 2 | 3 |"
    no_samples = {**SERVING, "resident_samples": [], "metrics": {"flashmemory_resident_fraction": 0.125}}
    assert (
        live_table(no_samples).splitlines()[2]
        == "| FlashMemory (KMAX 2 pages) | 2 | 200 | 3.0 | 16 | 0.125 | - | - | - | - |"
    )


def test_live_note_says_it_is_not_the_replay_model():
    note = live_note(SERVING)
    assert "tiny-dsv4-sglang" in note and "not the replay model" in note and "a retriever trained here" in note
    assert live_table({"error": "decode exited"}) == "Live serving failed: decode exited"
    assert live_note({"error": "x"}) == ""


def test_the_demos_own_retriever_serves_only_the_served_model(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    (tmp_path / "link").symlink_to(served)
    assert same_model(str(tmp_path / "link"), served) and not same_model("tiny-flash", served)

    def no_training(model, out):
        raise AssertionError("the demo's own checkpoint fits the served model: nothing to train")

    own = choose_retriever(str(served), tmp_path / "best.pt", (0, 1), served, tmp_path / "work", train=no_training)
    assert own.ckpt == tmp_path / "best.pt" and own.layers == (0, 1) and "stage 4" in own.note

    calls = []

    def train(model, out):
        calls.append((model, out))
        return out / "ckpt" / "best.pt"

    other = choose_retriever(
        "/m/dsv4-retrieval", tmp_path / "best.pt", (0, 1, 2), served, tmp_path / "work", train=train
    )
    assert calls == [(served, tmp_path / "work" / "serve_retriever")]
    assert other.ckpt == tmp_path / "work" / "serve_retriever" / "ckpt" / "best.pt" and other.layers == (0, 1)
    assert "trained here for the served model" in other.note and "dsv4-retrieval" in other.note
    assert "random token ids" in other.note  # no texts given
    on_text = choose_retriever(
        "/m/dsv4-retrieval", tmp_path / "best.pt", (0,), served, tmp_path / "w", train=train, texts=["some chat"] * 4
    )
    assert "4 of the demo's training documents" in on_text.note


def test_chat_text_is_the_served_chats_tail():
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "abc" * 10 + "Q?"}]
    assert ss.chat_text(msgs, 5) == "abcQ?"
    assert ss.chat_text(msgs, 1000).startswith("sys\n") and ss.chat_text(msgs, 1000).endswith("Q?")


def test_missing_serve_packages_are_named_before_the_first_stage(monkeypatch):
    from flashmemory.errors import UserError

    assert ss.missing_serve_modules(("json", "no_such_module_fm")) == ["no_such_module_fm"]
    monkeypatch.setattr(ss, "missing_serve_modules", lambda: ["nixl"])
    with pytest.raises(UserError, match=r"--serve needs the python packages nixl.*serve-nixl"):
        ss.check_serve_modules()


def test_a_server_that_does_not_start_is_reported_not_raised(monkeypatch, tmp_path):
    from flashmemory.serve import stack
    from flashmemory.serve.procs import ServerStartError

    monkeypatch.setattr(stack, "ensure_model", lambda p: tmp_path)
    monkeypatch.setattr(ss, "choose_retriever", lambda *a, **k: ss.ServedRetriever(tmp_path / "r.pt", (0, 1), "r"))

    def boom(*a, **k):
        raise ServerStartError("decode exited with 1\nlog tail: out of memory")

    monkeypatch.setattr(ss, "run_serve_stage", boom)
    lines = []
    res = ss.serve_demo("tiny-flash", tmp_path / "best.pt", (0,), [[]], tmp_path, 4, 2, 100, log=lines.append)
    assert res["error"].startswith("decode exited with 1 log tail: out of memory") and "serve_logs" in res["error"]
    assert any("live serving failed" in x for x in lines)


def test_dump_runs_lives_outside_the_pipeline():
    """The demo pipeline and the serving-tiny model's retriever both use dump_runs; its module
    (`serve.tiny_retriever`) does not pull in the pipeline."""
    code = (
        "import sys, flashmemory.serve.tiny_retriever; "
        "assert 'flashmemory.demo.pipeline' not in sys.modules, 'dumps pulled in the pipeline'"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2]
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_metrics_are_asked_again_when_a_busy_server_does_not_answer():
    answers = [(0, b""), (200, b"flashmemory_level1_cycles_total 4.0\nsglang:other 1\n")]
    asked = []

    def get(url, timeout):
        asked.append((url, timeout))
        return answers.pop(0)

    assert ss.read_metrics("http://d", tries=3, wait=0.0, get=get) == {"flashmemory_level1_cycles_total": 4.0}
    assert asked == [("http://d/metrics", 30.0)] * 2
    with pytest.raises(RuntimeError, match="answered nothing 2 times in a row"):
        ss.read_metrics("http://d", tries=2, wait=0.0, get=lambda url, timeout: (0, b""))
