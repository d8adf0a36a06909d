"""`flashmemory dump` itself: one clear line and the right exit status."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashmemory.cli import main
from flashmemory.dump import list_docs, read_metadata

ROOT = Path(__file__).resolve().parents[2]
EX = str(ROOT / "data_generation/example_data/tiny_chat.jsonl")


def dump(*args):
    return main(["dump", "--model", "micro", "--no-progress", *map(str, args)])


def err_line(capsys):
    prefix = "flashmemory dump: "  # the CLI's one error-line format (flashmemory.errors.fail)
    lines = [ln[len(prefix) :] for ln in capsys.readouterr().err.splitlines() if ln.startswith(prefix + "error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--max-tokens", "0"], "--max-tokens 0 must be >= 1"),
        (["--n-samples", "-1"], "--n-samples -1 must be >= 1"),
        (["--n-samples", "0"], "--n-samples 0 must be >= 1"),
        (["--start-idx", "-2"], "--start-idx -2 must be >= 0"),
        (["--start-idx", "3", "--end-idx", "2"], "--end-idx 2 must be greater than --start-idx 3"),
        (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens 0 must be >= 1"),
        (["--start-idx", "9"], "select no item (the file has 4 usable item(s)"),
    ],
)
def test_bad_numbers_are_one_line_before_anything_runs(tmp_path, capsys, flags, msg):
    assert dump("--input", EX, "--output-dir", tmp_path / "o", *flags) == 2
    assert msg in err_line(capsys)
    assert not (tmp_path / "o").exists()  # nothing generated, nothing created


def test_empty_or_all_malformed_input_exits_non_zero(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert dump("--input", empty, "--output-dir", tmp_path / "o") == 2
    assert "empty.jsonl: no usable input item (it is empty)" in err_line(capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"no_prompt": 1}\n')
    assert dump("--input", bad, "--output-dir", tmp_path / "o") == 2
    assert "bad.jsonl: no usable input item (all 2 non-blank line(s) are malformed" in err_line(capsys)
    assert dump("--input", tmp_path, "--output-dir", tmp_path / "o") == 2
    assert "--input is a directory" in err_line(capsys)


def test_output_dir_problems_are_one_line(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert dump("--input", EX, "--output-dir", f) == 2
    assert err_line(capsys) == f"error: {f}: --output-dir is a file, not a directory"


def test_unreadable_input_is_one_line(tmp_path, capsys, monkeypatch):
    from flashmemory.dump import inputs

    def unreadable(p):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(inputs, "_parse", unreadable)
    assert dump("--input", EX, "--output-dir", tmp_path / "o") == 2
    assert "tiny_chat.jsonl: cannot read the input file (Permission denied)" in err_line(capsys)


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="--max-tokens 0"):
        dump("--input", EX, "--output-dir", tmp_path / "o", "--max-tokens", "0", "--debug")


def test_missing_metadata_then_rerun_keeps_every_doc(tmp_path, capsys):
    """#2, the issue's command: dump, rm server_metadata.jsonl, rerun with --n-samples 1."""
    out = tmp_path / "out"
    assert dump("--input", EX, "--output-dir", out, "--max-tokens", "2", "--n-samples", "2") == 0
    files = {p.name: p.read_bytes() for p in out.glob("doc_*")}
    (out / "server_metadata.jsonl").unlink()
    capsys.readouterr()
    assert dump("--input", EX, "--output-dir", out, "--max-tokens", "2", "--n-samples", "1") == 0
    cap = capsys.readouterr()
    assert cap.err.count("adopted doc_0000") == 2 and "dumped 0 document(s)" in cap.out and "1 already done" in cap.out
    assert {p.name: p.read_bytes() for p in out.glob("doc_*")} == files


def test_oversized_prompt_fails_alone_is_recorded_and_not_retried(tmp_path, capsys):
    """#6: a prompt over the limit is a per-item error (no allocation), the rest are dumped, exit 1; a rerun
    skips it (recorded in failed_items.jsonl) instead of failing on it forever."""
    inp = tmp_path / "in.jsonl"
    msgs = ["a short prompt", "word " * 5000, "another short prompt"]
    inp.write_text("".join(json.dumps({"prompt": json.dumps([{"role": "user", "content": m}])}) + "\n" for m in msgs))
    out = tmp_path / "out"
    assert dump("--input", inp, "--output-dir", out, "--max-tokens", "2", "--max-prompt-tokens", "2000") == 1
    cap = capsys.readouterr()
    assert "in.jsonl:2: prompt of 25000 characters is far over the 2000-token limit" in cap.err
    assert "dumped 2 document(s)" in cap.out and "1 item(s) failed" in cap.out
    assert sorted(r["item_index"] for r in read_metadata(out)) == [0, 2]
    assert dump("--input", inp, "--output-dir", out, "--max-tokens", "2", "--max-prompt-tokens", "2000") == 1
    cap = capsys.readouterr()
    assert "skipping 1 item(s) that failed in an earlier run" in cap.err and "dumped 0 document(s)" in cap.out
    msgs[1] = "word " * 450  # over the limit only after tokenizing
    inp.write_text("".join(json.dumps({"prompt": json.dumps([{"role": "user", "content": m}])}) + "\n" for m in msgs))
    assert (
        dump("--input", inp, "--output-dir", out, "--max-tokens", "2", "--max-prompt-tokens", "2000", "--retry-failed")
        == 1
    )
    assert "prompt of 2" in capsys.readouterr().err  # tokens counted, still refused


@pytest.mark.slow
def test_two_dump_processes_on_one_dir_lose_nothing(tmp_path, capsys):
    """#3, the issue's shards: two real `flashmemory dump` processes on one --output-dir at once. One may be refused
    (one line naming the dir and the holder's pid, exit 2); nothing is lost or doubled, and after rerunning the
    refused shard every item is there exactly once."""
    out = tmp_path / "sh"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "flashmemory.cli",
        "dump",
        "--model",
        "micro",
        "--no-progress",
        "--input",
        EX,
        "--output-dir",
        str(out),
        "--max-tokens",
        "2",
    ]
    shards = [["--start-idx", "0", "--end-idx", "1"], ["--start-idx", "1", "--end-idx", "2"]]
    procs = [
        subprocess.Popen(cmd + s, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in shards
    ]
    results = [(p.wait(timeout=300), p.stderr.read(), p.pid) for p in procs]
    for (rc, err, _), (_, _, other) in zip(results, results[::-1]):
        assert rc in (0, 2), err
        if rc == 2:
            assert f"locked by another dump writer (pid {other})" in err
    meta = read_metadata(out)
    assert len({r["doc_index"] for r in meta}) == len(meta) == len(list_docs(out))
    assert sorted(r["item_index"] for r in meta) == sorted(
        i for (rc, _, _), s in zip(results, ((0,), (1,))) if rc == 0 for i in s
    )
    for (rc, _, _), s in zip(results, shards):
        if rc != 0:  # the refused shard, rerun (in-process)
            assert dump("--input", EX, "--output-dir", out, "--max-tokens", "2", *s) == 0
    meta = read_metadata(out)
    assert sorted(r["item_index"] for r in meta) == [0, 1] and len({r["doc_index"] for r in meta}) == 2
    capsys.readouterr()
    assert dump("--input", EX, "--output-dir", out, "--max-tokens", "2", "--end-idx", "2") == 0
    assert "2 already done" in capsys.readouterr().out  # and that is true now
