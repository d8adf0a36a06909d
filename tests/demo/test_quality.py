"""`flashmemory eval quality`: the document plan, resumable per-document records, the output-dir lock, and a report
whose every cell carries n and a 95% interval (no model runs here: the per-document work is stubbed)."""

from __future__ import annotations

import json
import math

import pytest

from flashmemory.cli import main
from flashmemory.demo.quality import (
    FORMAT,
    QualityConfig,
    doc_plan,
    fingerprint,
    load_done,
    run_pending,
    run_quality,
    write_doc,
)
from flashmemory.demo.quality_report import aggregate, report_markdown
from flashmemory.errors import UserError
from flashmemory.outdir import DirLock, DirLockedError

TASKS = ("niah_single", "niah_multikey", "mqar")
METHODS = ("Full", "FlashMemory", "FlashMemory+monitor", "Oracle")


def test_plan_continues_the_demos_test_documents() -> None:
    # the demo's test documents are i = 8..16 with task tasks[i % 3]: they are the plan's first nine
    plan = doc_plan(8, TASKS, (), 3)
    assert plan == [(i, TASKS[i % 3]) for i in range(8, 17)]
    big = doc_plan(8, TASKS, (), 48)
    assert len(big) == 144 and big[:9] == plan
    assert all(sum(t == task for _, t in big) == 48 for task in TASKS)
    only = doc_plan(8, TASKS, ("mqar",), 5)  # a task filter keeps each document's index (same seed, same doc)
    assert only == [(i, "mqar") for i in range(8, 30) if i % 3 == 2][:5]


def _metrics(score: float, mass: float, monitored: bool = False) -> dict:
    m = {
        "task_score": score,
        "mass": mass,
        "golden_recall": mass,
        "agreement": 1.0,
        "resident_frac": 0.2,
        "mean_pages": 3.0,
        "kmax": 4,
        "recall_bytes": 10.0,
        "level1_share": 0.01,
        "bytes_vs_full": 0.3,
    }
    if monitored:
        m |= {
            "miss_values": [0.1, 0.3],
            "miss_mass_mean": 0.2,
            "escalations": 1.0,
            "fallbacks": 0.0,
            "budget_matched": True,
            "target_pages": 3.0,
        }
    return m


def _rows(i: int) -> dict[str, dict]:
    s = float(i % 2)
    return {
        b: {
            "Full": _metrics(1.0, 1.0),
            "FlashMemory": _metrics(s, 0.7),
            "FlashMemory+monitor": _metrics(s, 0.6, True),
            "Oracle": _metrics(1.0 - s, 0.8),
        }
        for b in ("0.1", "0.2")
    }


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path) -> None:
    plan = doc_plan(8, TASKS, (), 2)
    calls: list[int] = []

    def flaky(i: int, task: str) -> dict:
        if len(calls) == 4:
            raise KeyboardInterrupt  # killed while the fifth document runs
        calls.append(i)
        return _rows(i)

    with pytest.raises(KeyboardInterrupt):
        run_pending(tmp_path, "fp", plan, flaky, {}, progress=False)
    done = load_done(tmp_path, "fp")
    assert sorted(done) == [i for i, _ in plan[:4]]
    assert not [p for p in (tmp_path / "docs").iterdir() if not p.name.endswith(".json")]  # no temp file left
    (tmp_path / "docs" / "00099.json").write_text('{"format": "flashmemory-quality/1", "budg')  # torn write
    again: list[int] = []
    todo = [(i, t) for i, t in plan if i not in load_done(tmp_path, "fp")]
    run_pending(tmp_path, "fp", todo, lambda i, t: again.append(i) or _rows(i), done, progress=False)
    assert again == [i for i, _ in plan[4:]]  # the done documents are skipped, the rest computed once
    assert sorted(load_done(tmp_path, "fp")) == [i for i, _ in plan]


def test_a_record_from_another_configuration_is_named(tmp_path) -> None:
    write_doc(
        tmp_path,
        {"format": FORMAT, "fingerprint": "aaaa", "index": 8, "task": "mqar", "seconds": 1.0, "budgets": _rows(8)},
    )
    with pytest.raises(UserError, match=r"00008\.json: written by a quality run with another configuration"):
        load_done(tmp_path, "bbbb")


def test_fingerprint_ignores_the_size_and_the_checkout_path() -> None:
    qc = QualityConfig()
    a = fingerprint({"model": "/x/trained/dsv4-retrieval", "tau": 16, "out_dir": "a"}, qc, METHODS)
    b = fingerprint(
        {"model": "/y/trained/dsv4-retrieval", "tau": 16, "out_dir": "b"},
        QualityConfig(n_per_task=96, out_dir="b"),
        METHODS,
    )
    assert a == b
    assert a != fingerprint({"model": "/x/trained/dsv4-retrieval", "tau": 8}, qc, METHODS)
    assert a != fingerprint({"model": "/x/trained/dsv4-retrieval", "tau": 16}, QualityConfig(budgets=(0.1,)), METHODS)


def test_a_second_writer_is_refused_before_any_work(tmp_path) -> None:
    with DirLock(tmp_path, "quality output directory"):
        with pytest.raises(DirLockedError, match="being written by another process"):
            run_quality(QualityConfig(out_dir=str(tmp_path)), log=lambda *_: None, progress=False)


def _results(n: int, planned: int) -> dict:
    recs = [{"index": i, "task": TASKS[i % 3], "seconds": 2.0, "budgets": _rows(i)} for i in range(8, 8 + n)]
    cfg = {
        "model": "/x/dsv4-retrieval",
        "doc_len": 1024,
        "gen_tokens": 24,
        "n_train": 6,
        "n_val": 2,
        "target_layers": [0, 1, 2],
        "tau": 16,
        "page_chunks": 8,
        "tail_chunks": 8,
        "fingerprint": "f",
        "quality": {
            "out_dir": "q",
            "n_per_task": 48,
            "budgets": [0.1, 0.2],
            "methods": [],
            "tasks": ["mqar"],
            "tau": 8,
            "seed": 0,
            "retriever": "",
        },
    }
    return aggregate(recs, cfg, "model dsv4-retrieval: the shipped trained tiny DeepSeek-V4", planned)


def test_every_cell_has_n_and_an_interval_and_a_partial_run_says_so() -> None:
    res = _results(12, 144)
    for methods in res["task_by_budget"].values():
        for name in METHODS:
            ci = methods[name]["task_score_ci"]
            assert ci["n"] == 12 and ci["method"] == "wilson" and ci["lo"] <= methods[name]["task_score"] <= ci["hi"]
            assert methods[name]["mass_ci"]["method"] == "bootstrap"
        for task in TASKS:
            assert {m: c["n"] for m, c in methods[f"task_ci:{task}"].items()} == dict.fromkeys(METHODS, 4)
    mon = res["monitor_by_budget"]["0.1"]["mqar"]
    assert set(mon) == {"FlashMemory", "FlashMemory+monitor", "Oracle"}
    assert mon["FlashMemory+monitor"]["miss_mass_mean_ci"]["n"] == 4
    md = report_markdown(res)
    assert "**12 of 144 planned documents are done**" in md
    assert "| Full | 12 | 1.000 [0.758, 1.000] | 1.000 [0.758, 1.000] |" in md  # Wilson, 12 of 12
    assert "The monitor's case" in md and "| 10% | mqar | FlashMemory+monitor | 4 |" in md
    assert (
        "Reproduce: `flashmemory eval quality --out-dir q --n-per-task 48 --budgets 0.1,0.2 --tasks mqar --tau 8`"
    ) in md
    assert "p10/p50/p90 0.100 / 0.300 / 0.300 over 24 readings" in md
    assert "All 144 planned documents are done." in report_markdown(_results(144, 144))
    assert json.loads(json.dumps(res, default=str))["docs_done"] == 12
    assert not math.isnan(res["methods_by_budget"]["0.2"]["FlashMemory"]["task_score_ci"]["lo"])


def test_cli_bad_flags_are_one_line(capsys) -> None:
    assert main(["eval", "quality", "--budgets", "0.1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budgets" in err[0]
    assert main(["eval", "quality", "--methods", "Nope"]) == 2
    assert "--methods: unknown Nope" in capsys.readouterr().err
    assert main(["eval", "quality", "--n-per-task", "0"]) == 2
    assert "--n-per-task 0" in capsys.readouterr().err


def test_plain_eval_still_requires_a_checkpoint(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["eval", "--dump", "somewhere"])
    assert e.value.code == 2
    assert "the following arguments are required: --checkpoint" in capsys.readouterr().err


def test_the_demo_report_points_to_the_quality_run() -> None:
    from flashmemory.demo.report import report_markdown as demo_markdown
    from tests.demo.test_report import _doc
    from tests.demo.test_report import _results as demo_results

    md = demo_markdown(demo_results([_doc(1.0, 0.8), _doc(0.0, 0.6), _doc(1.0, 0.7)]))
    assert "`flashmemory eval quality`" in md and "docs/quality/report.md" in md
