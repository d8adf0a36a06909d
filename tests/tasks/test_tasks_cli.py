"""`flashmemory tasks` command: generate all tasks, score, and exit 2 with a message on bad input."""

from __future__ import annotations

import json

import pytest

from flashmemory.cli import main


def test_generate_and_score(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert main(["tasks", "generate", "--task", "all", "--length", "1024", "--n", "1", "--out", str(out)]) == 0
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(recs) == 8 and all(r["n_tokens"] <= 1024 for r in recs)
    outs = tmp_path / "o.jsonl"
    outs.write_text("".join(json.dumps({"output": r["answer"]}) + "\n" for r in recs))
    assert main(["tasks", "score", "--items", str(out), "--outputs", str(outs)]) == 0
    assert "all                 8  1.000" in capsys.readouterr().out


def test_bad_input_exits_2_without_writing(tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    assert main(["tasks", "generate", "--task", "niah_single", "--length", "20", "--out", str(out)]) == 2
    assert "too short" in capsys.readouterr().err and not out.exists()
    assert main(["tasks", "generate", "--task", "vt", "--length", "900", "--depth", "2", "--out", str(out)]) == 2
    assert (
        main(
            [
                "tasks",
                "generate",
                "--task",
                "vt",
                "--length",
                "900",
                "--tokenizer",
                str(tmp_path / "nope"),
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_readme_task_files_go_to_an_ignored_folder():
    """The documented `tasks generate --out X` must not leave an untracked file in the repo root."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    outs = [o for d in docs for o in re.findall(r"tasks generate .*?--out (\S+)", d.read_text())]
    assert outs
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for out in outs:
        assert "/" in out, out  # not the repo root
        r = subprocess.run(["git", "check-ignore", "-q", out], cwd=root)
        assert r.returncode == 0, f"README writes {out}, which git does not ignore"
