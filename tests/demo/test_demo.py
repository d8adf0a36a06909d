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


@pytest.mark.parametrize("argv, msg", [
    (["demo", "--budget", "0"], "budget"),
    (["demo", "--budget", "1.5"], "budget"),
    (["demo", "--tasks", "nope"], "unknown task"),
])
def test_bad_arguments_are_clear_errors(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


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
    assert [r["tokens"] for r in rows] == [128, 256] and all(r["fm_pages_max"] <= 3 + 3 for r in rows)  # KMAX + decode region
    assert len(res["residency"]["costmodel"]) == 4 and "niah_single" in res["monitor_tasks"]
