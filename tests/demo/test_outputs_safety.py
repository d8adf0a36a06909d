"""`flashmemory demo`: a user's files in --out-dir are moved aside, never overwritten, and a --doc-len too short
for a task is named before any work. Fast: the model is never built (a sentinel stops the run at
the first real work)."""

from __future__ import annotations

import pytest

from flashmemory.cli import main
from flashmemory.demo import outputs, pipeline
from flashmemory.demo.config import DemoConfig, preset


class WorkStarted(Exception):
    """Raised where the demo would build its model: the first real work of a run."""


@pytest.fixture
def no_work(monkeypatch):
    from flashmemory.hf import HFEngine

    def stop(*a, **kw):
        raise WorkStarted

    monkeypatch.setattr(HFEngine, "from_name", classmethod(lambda cls, *a, **kw: stop()))


def test_doc_len_too_short_for_a_task_is_named_before_any_work(tmp_path, capsys, no_work) -> None:
    """The default monitor task (mrcr) needs ~384 tokens: `--doc-len 200` decoded, trained and replayed for
    minutes, then stopped in stage 6. README "Errors and data safety": a bad flag is one line naming it, with a
    non-zero exit (checked where it is read, so before the work it would spoil)."""
    out = tmp_path / "o"
    argv = [
        "demo",
        "--model",
        "micro",
        "--tasks",
        "niah_single",
        "--doc-len",
        "200",
        "--no-plot",
        "--no-progress",
        "--out-dir",
        str(out),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashmemory demo: error: --doc-len 200: length 200 is too short for task 'mrcr'"), err
    assert len(err.splitlines()) == 1
    assert not (out / "tasks.jsonl").exists() and not (out / "work").exists()
    assert main(argv[:4] + ["mqar", "--doc-len", "150"] + argv[7:]) == 2  # the run's own task, too
    assert "--doc-len 150: length 150 is too short for task 'mqar'" in capsys.readouterr().err


def test_a_users_outputs_are_moved_aside_never_overwritten(tmp_path, monkeypatch, no_work) -> None:
    """`demo --out-dir DIR` overwrote DIR/tasks.jsonl at once and report.md, results.json, coverage.png at the
    end. README "Errors and data safety": nothing is deleted that the project did not write as a temporary file;
    earlier files are moved aside with a message (and a backup is never overwritten either)."""
    monkeypatch.setattr(pipeline.time, "strftime", lambda *a: "20260101-000000")
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("tasks.jsonl", "results.json", "report.md", "coverage.png"):
        (out / name).write_text(f"user's {name}")
    (out / "tasks.jsonl.bak-20260101-000000").write_text("an older backup")
    lines: list[str] = []
    cfg = preset(DemoConfig(out_dir=str(out)), "test")
    with pytest.raises(WorkStarted):
        pipeline.run_demo(cfg, log=lines.append, progress=False)  # the test preset has plot=False
    assert (out / "tasks.jsonl.bak-20260101-000000").read_text() == "an older backup"
    assert (out / "tasks.jsonl.bak-20260101-000000-2").read_text() == "user's tasks.jsonl"
    for name in ("results.json", "report.md"):
        assert (out / f"{name}.bak-20260101-000000").read_text() == f"user's {name}"
        assert not (out / name).exists()
    assert (out / "coverage.png").read_text() == "user's coverage.png"  # no plot: the run does not write it
    moved = [ln for ln in lines if "moved earlier files" in ln]
    assert len(moved) == 1 and "tasks.jsonl -> tasks.jsonl.bak-20260101-000000-2" in moved[0]


def test_the_demos_own_outputs_are_replaced_and_edited_ones_kept(tmp_path) -> None:
    """Reruns of `make demo` do not pile up backups of the demo's own output; an output a user edited since
    is theirs and is moved aside."""
    out = tmp_path
    for name in outputs.OUTPUTS:
        (out / name).write_text(f"demo's {name}")
    outputs.record_outputs(out, outputs.OUTPUTS)
    assert outputs.move_aside_outputs(out, outputs.OUTPUTS, log=lambda *a: None) == []
    (out / "report.md").write_text("demo's report.md, with my notes")
    (out / "results.json").unlink()
    (out / "results.json").mkdir()  # whatever it is, it is not ours
    moved = dict(outputs.move_aside_outputs(out, outputs.OUTPUTS, log=lambda *a: None))
    assert set(moved) == {"report.md", "results.json"}
    assert (out / moved["report.md"]).read_text().endswith("with my notes") and (out / moved["results.json"]).is_dir()
    assert (out / "tasks.jsonl").read_text() == "demo's tasks.jsonl"  # left for the run to replace


def test_a_seed_out_of_range_names_the_flag(tmp_path, capsys, no_work) -> None:
    """Was torch's "Overflow when unpacking long long" at the start of the run. Promise: every numeric input is
    range-checked where it is read; the error names the flag."""
    assert main(["demo", "--seed", str(2**64), "--model", "micro", "--out-dir", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
    assert capsys.readouterr().err == f"flashmemory demo: error: --seed {2**64}: must lie in [0, 2**32)\n"
