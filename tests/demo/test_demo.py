"""The demo's quick path end to end on the micro model, and its argument checks."""

import json

import pytest

from flashmemory.cli import main
from flashmemory.demo.config import DemoConfig, preset
from flashmemory.eval.methods import METHODS


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from flashmemory.demo.pipeline import run_demo

    out = tmp_path_factory.mktemp("demo_out")
    cfg = preset(DemoConfig(out_dir=str(out)), "test")
    return out, run_demo(cfg, log=lambda *a: None, progress=False)


def test_report_has_every_method_row(demo_run):
    out, res = demo_run
    report = (out / "report.md").read_text()
    for name in ("Full", *METHODS):
        assert f"| {name} |" in report, name
        assert name in res["methods"]
    assert json.loads((out / "results.json").read_text())["methods"].keys() == res["methods"].keys()


def test_full_row_is_the_reference_and_methods_are_partial(demo_run):
    _, res = demo_run
    full = res["methods"]["Full"]
    assert full["mass"] == pytest.approx(1.0) and full["agreement"] == 1.0 and full["resident_frac"] == 1.0
    for name in METHODS:
        m = res["methods"][name]
        assert 0.0 < m["resident_frac"] < 1.0, name
        assert 0.0 <= m["mass"] <= 1.0 and 0.0 <= m["agreement"] <= 1.0
        assert m["recall_bytes"] > 0, f"{name} recalled nothing through the engine"
    # the budget sweep covers every method at every budget
    assert set(res["sweep"]) == {"0.25", "0.5"}
    assert all(set(v) == set(METHODS) for v in res["sweep"].values())


def test_oracle_beats_recency_on_golden_recall_given_room(demo_run):
    """The oracle reads the future golden labels: with the same pages it cannot do worse than recency."""
    _, res = demo_run
    for v in res["sweep"].values():
        assert v["Oracle"]["mass"] >= 0.0
    assert res["methods"]["Oracle"]["golden_recall"] >= res["methods"]["Recency"]["golden_recall"] - 1e-9


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["demo", "--budget", "0"], "budget"),
        (["demo", "--budget", "1.5"], "budget"),
        (["demo", "--tasks", "nope"], "unknown task"),
    ],
)
def test_bad_arguments_are_clear_errors(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_auto_model_picks_the_trained_checkpoint_or_says_it_fell_back(monkeypatch):
    from flashmemory.demo import config as dc
    from flashmemory.tiny import shipped

    cfg, note = dc.resolve_model(DemoConfig())
    if shipped.trained_model_available():
        assert cfg.model == str(shipped.trained_model_dir()) and "trained" in note
        assert cfg.tasks == dc.TRAINED["tasks"] and cfg.gen_tokens == dc.TRAINED["gen_tokens"]
        # a field the user set is kept
        cfg2, _ = dc.resolve_model(DemoConfig(n_test=2, tasks=("niah_single",)), {"n_test", "tasks"})
        assert cfg2.n_test == 2 and cfg2.tasks == ("niah_single",)
    monkeypatch.setattr(shipped, "trained_model_available", lambda: False)
    cfg, note = dc.resolve_model(DemoConfig())
    assert cfg.model == "tiny-flash" and "RANDOM" in note and cfg.tasks


def test_task_budget_table(demo_run):
    out, res = demo_run
    tb = res["task_by_budget"]
    assert set(tb) == {"0.1", "0.2"}
    for b in tb.values():
        assert {"Full", *METHODS} <= set(b)
        assert any(k.startswith("task:") for k in b)
    assert "## Task accuracy by page budget" in (out / "report.md").read_text()


def _args(*argv):
    from flashmemory.cli import build_parser

    return build_parser().parse_args(["demo", *argv])


def test_quick_writes_to_its_own_folder_and_knows_its_stage_times():
    from flashmemory.demo.cli import config_from_args, expected_seconds

    full, quick = config_from_args(_args()), config_from_args(_args("--quick"))
    assert full.out_dir == "demo_out" and quick.out_dir == "demo_out_quick"
    assert config_from_args(_args("--quick", "--out-dir", "x")).out_dir == "x"
    assert expected_seconds(quick, True) is not None and expected_seconds(full, False) is not None
    assert expected_seconds(config_from_args(_args("--quick", "--epochs", "99")), True) is None  # other workload


def test_a_slow_stage_is_named_while_it_runs():
    import threading

    from flashmemory.demo.pipeline import Stages, slow_warning

    assert slow_warning("3. decode", 200.0, 70.0) is None
    msg = slow_warning("3. decode", 232.0, 70.0)  # the quick demo's decode stage on this box under load
    assert msg.startswith("[demo] warning: stage '3. decode' has taken 232 s, over 3x the ~70 s") and "CPU" in msg
    assert slow_warning("1. build model", 3.5, 1.0) is None  # 3x, but only seconds: noise
    lines, seen = [], threading.Event()

    def log(line):
        lines.append(line)
        if "warning" in line:
            seen.set()

    st = Stages(log, {"slow": 0.01, "fast": 3600.0}, excess=0.0)
    with st("slow"):
        assert seen.wait(30), lines  # the warning comes while the stage is still running
    with st("fast"):
        pass
    assert st.warned == ["slow"] and sum("warning" in x for x in lines) == 1


def test_work_dir_is_removed_only_if_the_demo_wrote_it(tmp_path):
    from flashmemory.demo.config import WORK_MARKER
    from flashmemory.demo.outputs import clean_work_dir
    from flashmemory.errors import UserError

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mine.txt").write_text("user data")
    with pytest.raises(UserError, match="was not written by the demo"):
        clean_work_dir(tmp_path)
    assert (tmp_path / "work" / "mine.txt").read_text() == "user data"
    (tmp_path / "work" / "mine.txt").unlink()
    (tmp_path / "work" / WORK_MARKER).write_text("x")
    (tmp_path / "work" / "stale.safetensors").write_text("old run")
    clean_work_dir(tmp_path)
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == [WORK_MARKER]


def test_a_locked_out_dir_is_refused(tmp_path):
    from flashmemory.demo.pipeline import run_demo
    from flashmemory.outdir import DirLock, DirLockedError

    with DirLock(tmp_path):
        with pytest.raises(DirLockedError, match="demo output directory is being written"):
            run_demo(preset(DemoConfig(out_dir=str(tmp_path)), "test"), log=lambda *a: None, progress=False)


def test_no_progress_prints_no_training_bar(synth, tmp_path, capfd):
    from flashmemory.train.loop import TrainConfig, Trainer

    cfg = dict(
        data_config=str(synth / "data.json"),
        no_pretrain=True,
        joint_layers=(0, 1),
        n_heads=8,
        q_lora_rank=32,
        epochs=1,
        batch_size=8,
        log_interval=10**9,
    )
    Trainer(TrainConfig(output_dir=str(tmp_path / "a"), **cfg)).fit()
    assert "epoch 0:" in capfd.readouterr().err  # the bar, as a terminal would show it
    Trainer(TrainConfig(output_dir=str(tmp_path / "b"), progress=False, **cfg)).fit()
    err = capfd.readouterr().err
    assert "epoch 0" not in err and "\r" not in err


def test_report_compares_monitor_and_tabulates_residency(demo_run):
    out, res = demo_run
    report = (out / "report.md").read_text()
    assert "## Miss monitor: FlashMemory vs FlashMemory+monitor" in report
    assert "## Resident pages per request against context length" in report
    mon, fm = res["methods"]["FlashMemory+monitor"], res["methods"]["FlashMemory"]
    assert mon["mean_pages"] <= fm["mean_pages"] + 1e-9 or not mon["budget_matched"], "budgets must be matched"
    assert mon["monitor_cycles"] > 0 and len(mon["miss_values"]) > 0
    assert all(0.0 <= v <= 1.0 for v in mon["miss_values"])
    rows = res["residency"]["rows"]
    assert [r["tokens"] for r in rows] == [128, 256]
    assert all(r["fm_pages_max"] <= 3 + 3 for r in rows)  # KMAX + decode region
    assert len(res["residency"]["costmodel"]) == 4 and "niah_single" in res["monitor_tasks"]


def test_serve_adds_stage_7_and_keeps_the_replay_model():
    from flashmemory.demo.cli import config_from_args, expected_seconds
    from flashmemory.demo.config import SERVE_STAGE

    assert DemoConfig().serve is False  # tests and `flashmemory demo` start no servers unless asked
    plain, served = config_from_args(_args()), config_from_args(_args("--serve", "--serve-kmax", "4"))
    assert served.serve and served.serve_kmax == 4 and served.model == plain.model == "auto"
    assert SERVE_STAGE in expected_seconds(served, False) and SERVE_STAGE not in expected_seconds(plain, False)
    assert expected_seconds(config_from_args(_args("--quick", "--serve")), True)[SERVE_STAGE] > 0


def test_live_row_sits_beside_the_replay_table(demo_run):
    from flashmemory.demo.report import report_markdown
    from tests.demo.test_serve_stage import SERVING

    _, res = demo_run
    assert "Live serving" not in report_markdown(res)
    md = report_markdown({**res, "serving": SERVING})
    replay, live, tasks = md.index("| Reactive |"), md.index("| FlashMemory (KMAX 2 pages) |"), md.index("## Task acc")
    assert replay < live < tasks and "not the replay model" in md[live:tasks]


def test_a_failed_serving_stage_fails_the_command(monkeypatch, capsys):
    from flashmemory.demo import pipeline

    monkeypatch.setattr(pipeline, "run_demo", lambda *a, **k: {"serving": {"error": "router did not start"}})
    assert main(["demo", "--serve"]) == 1
    assert "live serving (stage 7) failed: router did not start" in capsys.readouterr().err


def test_a_rerun_knows_the_demos_own_outputs(demo_run):
    """The outputs a run wrote are recorded as its own, so `make demo` run again replaces them instead of
    piling up backups (a user's file there is moved aside: tests/demo/test_outputs_safety.py)."""
    from flashmemory.demo.outputs import move_aside_outputs

    out, _ = demo_run
    assert move_aside_outputs(out, ("tasks.jsonl", "results.json", "report.md"), log=lambda *a: None) == []
