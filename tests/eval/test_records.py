"""Resumable run directories of `eval quality` and `eval frontier` (`eval.records`, `outdir.claim_kind`): each
refuses the other's directory, a hand-edited record is one line naming the file and the field, budgets that print
alike are refused, both commands refuse the same tasks, and --n-per-task is bounded (no model runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashmemory.cli import main
from flashmemory.demo import quality as q
from flashmemory.errors import UserError
from flashmemory.eval.budgets import parse_budgets
from flashmemory.eval.frontier import run as fr
from tests.eval.frontier.test_run import FakeSweep


@pytest.fixture
def fc(tmp_path):
    ck = tmp_path / "r.safetensors"
    ck.write_bytes(b"weights")
    return fr.FrontierConfig(
        out_dir=str(tmp_path / "out"), retriever=str(ck), n_per_task=1, budgets=(0.1, 0.5), tasks=("mqar",)
    )


def _quality_record(i: int = 8) -> dict:
    row = {"task_score": 1.0, "mass": 1.0, "agreement": 1.0}
    rows = {"Full": dict(row), "FlashMemory": dict(row)}
    return {
        "format": q.FORMAT,
        "fingerprint": "f",
        "index": i,
        "task": "mqar",
        "seconds": 1.0,
        "budgets": {"0.1": rows},
    }


def test_frontier_refuses_a_quality_dir_and_leaves_its_records(fc, monkeypatch):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    out = Path(fc.out_dir)
    rec = q.write_doc(out, _quality_record(8))  # index 8: the frontier's first document
    before = rec.read_bytes()
    with pytest.raises(UserError, match=r"--out .*holds the output of `flashmemory eval quality`") as e:
        fr.run_frontier(fc, log=lambda s: None, progress=False)
    assert "\n" not in str(e.value)
    assert rec.read_bytes() == before and not (out / "frontier.json").exists()


def test_quality_refuses_a_frontier_dir_before_any_work(fc, monkeypatch):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    fr.run_frontier(fc, log=lambda s: None, progress=False)
    marker = Path(fc.out_dir) / ".flashmemory-kind"
    assert marker.read_text().strip() == "eval frontier"
    marker.unlink()  # an unmarked frontier dir (older runs) is known by its records' format tag

    def no_work(qc):
        raise AssertionError("the quality run started in a frontier dir")

    monkeypatch.setattr(q, "demo_config", no_work)
    with pytest.raises(UserError, match=r"--out-dir .*holds the output of `flashmemory eval frontier`"):
        q.run_quality(q.QualityConfig(out_dir=fc.out_dir), log=lambda s: None, progress=False)


def test_a_marked_quality_dir_is_refused_even_without_records(fc, monkeypatch, capsys):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    Path(fc.out_dir).mkdir()
    (Path(fc.out_dir) / ".flashmemory-kind").write_text("eval quality\n")
    argv = ["eval", "frontier", "--out", fc.out_dir, "--retriever", fc.retriever, "--tasks", "mqar"]
    assert main(argv + ["--n-per-task", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "eval quality" in err[0]


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda r: r.pop("budgets"), "budgets"),
        (lambda r: r.update(budgets={}), "budgets"),
        (lambda r: r["budgets"]["0.1"].update(FlashMemory={}), "budgets.0.1.FlashMemory"),
        (lambda r: r["budgets"]["0.1"]["Full"].pop("task_score"), "budgets.0.1.Full.task_score"),
        (lambda r: r["budgets"]["0.1"]["Full"].update(mass="high"), "budgets.0.1.Full.mass"),
        (lambda r: r["budgets"].pop("0.5"), "budgets"),
        (lambda r: r.pop("n_chunks"), "n_chunks"),
    ],
)
def test_a_hand_edited_frontier_record_is_one_line_naming_file_and_field(fc, monkeypatch, edit, field):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    fr.run_frontier(fc, log=lambda s: None, progress=False)
    path = Path(fc.out_dir) / "docs" / "00008.json"
    rec = json.loads(path.read_text())
    edit(rec)
    path.write_text(json.dumps(rec))
    before = path.read_bytes()
    with pytest.raises(UserError) as e:
        fr.run_frontier(fc, log=lambda s: None, progress=False, report_only=True)
    msg = str(e.value)
    assert str(path) in msg and f"field {field}" in msg and "\n" not in msg
    with pytest.raises(UserError):  # nor is it redone (overwritten) by a plain rerun
        fr.run_frontier(fc, log=lambda s: None, progress=False)
    assert path.read_bytes() == before


def test_a_quality_record_with_no_metrics_is_named(tmp_path):
    rec = _quality_record()
    rec["budgets"]["0.1"]["FlashMemory"] = {}
    q.write_doc(tmp_path, rec)
    with pytest.raises(UserError, match=r"00008\.json: field budgets\.0\.1\.FlashMemory holds no metrics"):
        q.load_done(tmp_path, "f")
    rec = _quality_record(9)
    rec["budgets"] = {"0.1": {"Full": {"task_score": 1.0}}}  # methods unlike the other records': the report ends
    (tmp_path / "docs" / "00008.json").unlink()
    q.write_doc(tmp_path, _quality_record(8))
    q.write_doc(tmp_path, rec)
    with pytest.raises(UserError, match=r"00009\.json: field budgets\.0\.1 holds methods Full; 00008\.json holds"):
        q.load_done(tmp_path, "f")


@pytest.mark.parametrize("raw", ["0.1,0.1000001", "0.2,0.2"])
def test_budgets_that_print_alike_are_refused(fc, monkeypatch, capsys, raw):
    with pytest.raises(UserError, match="--budgets"):
        parse_budgets(raw)
    with pytest.raises(UserError, match="--budgets"):  # a config built directly, too: one record entry each
        fr.FrontierConfig(**{**fc.__dict__, "budgets": tuple(map(float, raw.split(",")))})
    with pytest.raises(UserError, match="--budgets"):
        q.QualityConfig(budgets=tuple(map(float, raw.split(","))))
    argv = ["eval", "frontier", "--out", fc.out_dir, "--retriever", fc.retriever, "--budgets", raw]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budgets" in err[0]
    assert parse_budgets("0.1,0.100001") == (0.1, 0.100001)  # distinct to 6 digits: two entries


def test_both_commands_refuse_the_same_tasks(fc):
    from flashmemory.tasks.suite import TASKS

    def refused(make) -> bool:
        try:
            make()
        except UserError as e:
            assert "--tasks" in str(e)
            return True
        return False

    for task in tuple(TASKS) + ("nope",):
        by_quality = refused(lambda: q.demo_config(q.QualityConfig(tasks=(task,))))
        by_frontier = refused(lambda: fr.FrontierConfig(**{**fc.__dict__, "tasks": (task,)}))
        assert by_quality == by_frontier, task
        assert by_quality == (task not in fr.TRAINED_TASKS), task
    twice = ("mqar", "mqar")
    assert refused(lambda: q.demo_config(q.QualityConfig(tasks=twice)))
    assert refused(lambda: fr.FrontierConfig(**{**fc.__dict__, "tasks": twice}))


def test_the_shipped_model_by_its_path_takes_the_trained_tasks_only(fc):
    from flashmemory.eval.frontier.identity import settings
    from flashmemory.tiny.shipped import trained_model_dir

    with pytest.raises(UserError, match="--tasks: vt not among the trained model's tasks"):
        settings(fr.FrontierConfig(**{**fc.__dict__, "model": str(trained_model_dir()), "tasks": ("vt",)}))


@pytest.mark.parametrize("cmd", [["eval", "quality"], ["eval", "frontier", "--retriever", "r.safetensors"]])
def test_a_huge_n_per_task_is_a_bounded_flag_error(cmd, capsys):
    assert main(cmd + ["--n-per-task", "1000000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--n-per-task 1000000000: must lie in [1, 100000]" in err[0]
