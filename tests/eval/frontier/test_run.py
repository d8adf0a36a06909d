"""`flashmemory eval frontier`: sweep shape, resume, the iso-quality pick, costs and one-line argument errors.

The sweep and resume tests replace the model pass (`Sweep`) with a synthetic one so they take seconds; the
shared-prefix decoder against the full forward and one real document on the micro model are
tests/eval/frontier/test_decode.py's."""

from __future__ import annotations

import json
import math

import pytest

from flashmemory.cli import main
from flashmemory.eval.frontier import run as fr
from flashmemory.eval.frontier.cost import KV_BYTES, method_costs
from flashmemory.eval.frontier.report import iso_quality

METHODS = ("Full", "FlashMemory", "FlashMemory+monitor", "Oracle", "Recency", "HiSparse")  # the default sweep


def _row(acc: float, budget: float, name: str) -> dict:
    kmax = max(1, math.ceil(budget * 10))
    m = {
        "task_score": acc,
        "agreement": acc,
        "mass": min(1.0, budget * 2),
        "resident_frac": budget,
        "golden_recall": acc,
        "kmax": kmax,
        "recall_bytes": 100.0 * kmax,
        "cost_pending": False,
        "resident_per_topk": kmax * 8 / 16,
        "hit_rate": 0.5 + budget / 2 if name == "HiSparse" else float("nan"),
    }
    m |= method_costs(
        name,
        m,
        n_c4=3,
        n_target=3,
        n_final=80,
        n_vis_mean=78.0,
        n_steps=4,
        index_bytes=68,
        page_chunks=8,
        tau=4,
        l1_flops=1000.0,
        hot_slots=kmax * 8,
        swap_misses=10 * (1 - budget),
    )
    return m


class FakeSweep:
    """Stands in for the model pass: FlashMemory's accuracy grows with the budget, Full and HiSparse score 1."""

    calls: list[int] = []

    def __init__(self, fc):
        self.fc = fc

    def doc(self, i: int, task: str) -> dict:
        FakeSweep.calls.append(i)
        budgets = {}
        for b in self.fc.budgets:
            budgets[f"{b:g}"] = {
                name: _row(
                    1.0 if name in ("Full", "HiSparse", "FlashMemory-fill") else (1.0 if b >= 0.5 else 0.0), b, name
                )
                for name in ("Full", "HiSparse") + self.fc.methods
            }
        return {"budgets": budgets, "n_chunks": 80, "prompt_len": 316, "index_topk": 16, "forced_forwards": 0}


@pytest.fixture
def cfg(tmp_path):
    ck = tmp_path / "r.safetensors"
    ck.write_bytes(b"weights")
    return fr.FrontierConfig(
        out_dir=str(tmp_path / "out"),
        retriever=str(ck),
        n_per_task=2,
        budgets=(0.1, 0.25, 0.5, 1.0),
        tasks=("niah_single", "mqar"),
    )


def test_sweep_shape_and_resume(cfg, monkeypatch):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    FakeSweep.calls = []
    res = fr.run_frontier(cfg, log=lambda s: None, progress=False, max_docs=3)
    assert FakeSweep.calls == [8, 9, 10]  # tasks cycle from --first-doc; the 4th is left for later
    assert res["docs_done"] == 3 and res["docs_planned"] == 4
    assert list(res["methods"]) == ["0.1", "0.25", "0.5", "1"]
    assert set(res["methods"]["0.1"]) == set(METHODS)
    cell = res["methods"]["0.5"]["FlashMemory"]
    assert cell["task_score_ci"]["n"] == 3 and cell["task_score_ci"]["method"] == "wilson"
    assert {p["ctx"] for p in res["projection"]["0.5"]} == {131072, 262144, 1048576}
    assert {p["method"] for p in res["projection"]["0.5"]} == {"Full", "FlashMemory", "HiSparse"}
    out = fr.Path(cfg.out_dir)
    assert (out / "frontier.png").stat().st_size > 1000
    md = (out / "frontier.md").read_text()
    assert "flashmemory eval frontier --out" in md and "3 of 4 planned" in md
    # rerun: only the missing document is computed; the finished ones are read back
    res = fr.run_frontier(cfg, log=lambda s: None, progress=False)
    assert FakeSweep.calls == [8, 9, 10, 11] and res["docs_done"] == 4
    assert json.loads((out / "frontier.json").read_text())["docs_per_task"] == {"niah_single": 2, "mqar": 2}


def test_record_of_another_configuration_stops_the_run(cfg, monkeypatch):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    fr.run_frontier(cfg, log=lambda s: None, progress=False, max_docs=1)
    other = fr.FrontierConfig(**{**cfg.__dict__, "tau": 8})
    with pytest.raises(fr.UserError, match=r"00008\.json.*another configuration"):
        fr.run_frontier(other, log=lambda s: None, progress=False)


def _res(accs: dict[str, float], full: float = 0.8) -> dict:
    methods = {}
    for b, a in accs.items():
        rows = {
            "Full": {"task_score": full},
            "HiSparse": {"task_score": full, "device_bytes": 2.0},
            "FlashMemory": {
                "task_score": a,
                "task_score_ci": {"lo": a - 0.1, "hi": a + 0.1},
                "resident_per_topk": float(b) * 64,
                "device_bytes": 1.0,
            },
        }
        methods[b] = rows
    return {"methods": methods, "tasks": {b: {} for b in accs}}


def test_iso_quality_picks_the_smallest_budget_reaching_each_ratio():
    res = _res({"0.4": 0.79, "0.05": 0.5, "0.2": 0.77, "0.1": 0.7, "0.8": 0.8})
    iso = iso_quality(res, ["overall"])["overall"]
    assert iso["0.95"]["budget"] == "0.2"  # 0.77 >= 0.95 x 0.8 = 0.76; 0.1 gives 0.70
    assert iso["0.99"]["budget"] == "0.8"  # 0.99 x 0.8 = 0.792: 0.79 at 0.4 falls short
    assert iso["0.95"]["costs"]["HiSparse"]["device_bytes"] == 2.0


def test_iso_quality_not_reached():
    iso = iso_quality(_res({"0.1": 0.1, "0.5": 0.3}), ["overall"])["overall"]
    assert iso["0.95"]["budget"] is None and iso["0.99"]["budget"] is None
    iso = iso_quality(_res({"0.1": 0.0, "0.5": 0.0}, full=0.0), ["overall"])["overall"]
    assert iso["0.95"]["budget"] is None and iso["0.95"]["note"] == "Full scores 0"


def test_method_costs_hand_worked():
    shape = dict(
        n_c4=3,
        n_target=3,
        n_final=100,
        n_vis_mean=98.0,
        n_steps=4,
        index_bytes=68,
        page_chunks=8,
        tau=4,
        l1_flops=500.0,
    )
    full = method_costs("Full", {}, **shape)
    assert full["device_bytes"] == 3 * 100 * (KV_BYTES + 68) and full["h2d_per_token"] == 0.0
    assert full["scored_per_token"] == 3 * 98.0
    hs = method_costs("HiSparse", {}, hot_slots=40, swap_misses=6.0, **shape)
    assert hs["device_parts"]["c4 kv"] == 3 * 41 * KV_BYTES  # H slots + the newest-entry slot per c4 layer
    assert hs["h2d_per_token"] == 6.0 * KV_BYTES / 4
    fm = method_costs("FlashMemory", {"kmax": 5, "recall_bytes": 800.0, "resident_frac": 0.25}, **shape)
    assert fm["device_parts"]["c4 kv"] == 3 * 40 * KV_BYTES  # the KMAX reserve: 5 pages of 8 chunks
    assert fm["h2d_per_token"] == 200.0 and fm["l1_flops_per_token"] == 500.0
    assert fm["scored_per_token"] == 3 * 0.25 * 98.0 + 3 * 98.0 / 4  # Level 2 resident + Level 1 over tau
    mon = method_costs("FlashMemory+monitor", {"kmax": 5, "cap_pages": 10}, **shape)
    assert mon["device_parts"]["c4 kv"] == 3 * 80 * KV_BYTES  # the escalation cap is reserved
    assert method_costs("Recency", {"kmax": 5}, **shape)["l1_flops_per_token"] == 0.0


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--budgets", "0"], "--budgets"),
        (["--budgets", "0.1,1.5"], "--budgets"),
        (["--budgets", "x"], "--budgets"),
        (["--methods", "FlashMemory,Bogus"], "--methods"),
        (["--tasks", "nope"], "--tasks"),
        (["--n-per-task", "0"], "--n-per-task"),
        (["--doc-len", "8"], "--doc-len"),
        (["--max-docs", "-1"], "--max-docs"),
        (["--retriever", "MISSING"], "MISSING"),
    ],
)
def test_bad_arguments_one_line(tmp_path, capsys, extra, needle):
    ck = tmp_path / "r.safetensors"
    ck.write_bytes(b"x")
    argv = ["eval", "frontier", "--out", str(tmp_path / "o"), "--retriever", str(ck)] + [
        str(tmp_path / "missing.safetensors") if x == "MISSING" else x for x in extra
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashmemory eval frontier: error:")
    assert (needle if needle != "MISSING" else "missing.safetensors") in err[0]


def test_equal_budget_search_can_start_at_the_target():
    """With max_base the search starts there: same kind of match, without replaying every base above it."""
    from types import SimpleNamespace

    import torch

    from flashmemory.eval.monitored import equal_budget_replay

    tried: list[int] = []

    def replay(base: int, monitor=None, cap=None):
        tried.append(base)
        res = torch.zeros(4, 64 * 4, dtype=torch.bool)
        res[:, : (base + 1) * 4] = True  # the monitored method holds base + 1 pages of 4 chunks
        return SimpleNamespace(resident=res)

    _, info = equal_budget_replay(replay, 6.0, 40, 40, 4, lambda b, c: None)
    assert info["base_pages"] == 5 and tried[0] == 40 and len(tried) > 35 * 1
    tried.clear()
    _, info = equal_budget_replay(replay, 6.0, 40, 40, 4, lambda b, c: None, max_base=6)
    assert info["base_pages"] == 5 and tried == [6] * tried.count(6) + [5]


def _picks_run():
    """A Full run stand-in: 1 c4 layer, prompt 64 tokens (16 chunks), 8 decode steps; every step picks chunks
    0..3 and then, from step 4 on, chunks 8..11 (a second needle)."""
    from types import SimpleNamespace

    import torch

    P, T = 64, 8
    topk = torch.full((P + T, 4), -1, dtype=torch.long)
    for t in range(T):
        topk[P + t] = torch.tensor([0, 1, 2, 3]) if t < 4 else torch.tensor([8, 9, 10, 11])
    return SimpleNamespace(prompt_len=P, n_steps=T, topk={0: topk}, index_chunks=torch.zeros(1, (P + T) // 4, 5))


def test_hisparse_arm_replays_the_runs_picks_and_the_prefetch_hint():
    import torch

    run = _picks_run()
    big = fr.hisparse_stats(run, 64)  # the whole history fits: sglang's fast path, nothing moves
    assert big["misses"] == 0 and big["hit_rate"] == 1.0
    small = fr.hisparse_stats(run, 8)  # PD admission: empty buffer, each needle missed once
    assert small["misses"] == 8 and small["hits"] == 3 * 4 + 3 * 4
    resident = torch.zeros(8, 18, dtype=torch.bool)
    resident[:, 8:12] = True  # FlashMemory already holds the second needle at step 0
    hint = fr.prefetch_hint(resident, 4)
    assert sorted(hint) == [0, 4] and hint[0].tolist() == [8, 9, 10, 11]
    pre = fr.hisparse_stats(run, 8, hint)
    assert pre["misses"] == 4 and pre["prefetched"] == 4 and pre["prefetch_hits"] == 4


def test_compare_sets_another_runs_methods_beside_flashmemory(cfg, monkeypatch):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    fill = fr.FrontierConfig(**{**cfg.__dict__, "out_dir": cfg.out_dir + "_fill", "methods": ("FlashMemory-fill",)})
    fr.run_frontier(fill, log=lambda s: None, progress=False, max_docs=3)
    fr.run_frontier(cfg, log=lambda s: None, progress=False, max_docs=2, compare=fill.out_dir)
    md = (fr.Path(cfg.out_dir) / "frontier.md").read_text()
    assert f"--compare {fill.out_dir}" in md and "2 documents in both runs; FlashMemory-fill from" in md
    assert "| 10% | FlashMemory-fill | 2 | 1.000" in md and "| 10% | FlashMemory | 2 | 0.000" in md
    rec = fr.Path(fill.out_dir) / "docs" / "00009.json"
    body = json.loads(rec.read_text())
    rec.write_text(json.dumps(body | {"prompt_len": 1}))
    with pytest.raises(fr.UserError, match="document 9 differs"):
        fr.run_frontier(cfg, log=lambda s: None, progress=False, report_only=True, compare=fill.out_dir)


def test_fill_method_fills_the_budget_by_score_where_the_threshold_keeps_less():
    from dataclasses import replace

    import torch

    from flashmemory.eval.harness import HarnessConfig
    from flashmemory.eval.methods import METHODS, MassPagePolicy, make_method
    from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy

    for extra in ("FlashMemory-fill", "FlashMemory-threshold"):
        assert extra not in METHODS  # never in a default method list (eval quality's stays)
        HarnessConfig(methods=(extra,))  # but the harness runs it when asked
    sel = SelectionConfig(threshold=0.5, last_keep=4, page_chunks=4, kmax=6)
    from types import SimpleNamespace

    eng = SimpleNamespace(layout=SimpleNamespace(target_layers=()))
    _, pol = make_method("FlashMemory-fill", None, sel, eng, retriever=SimpleNamespace(layers=()))
    assert isinstance(pol, MassPagePolicy)
    with pytest.raises(ValueError, match="retriever"):
        make_method("FlashMemory-fill", None, sel, None)
    scores = torch.zeros(40)
    scores[[1, 9, 21]] = torch.tensor([0.9, 0.3, 0.2])  # one chunk above the threshold, two below it
    kept_fill = pol(scores, 40, 6).tolist()
    _, thr = make_method("FlashMemory-threshold", None, sel, eng, retriever=SimpleNamespace(layers=()))
    _, default = make_method("FlashMemory", None, sel, eng, retriever=SimpleNamespace(layers=()))
    kept_thr = thr(scores, 40, 6).tolist()
    assert len(kept_fill) == 6 and {0, 2, 5, 9}.issubset(kept_fill)  # scored pages + the tail, then the newest
    assert kept_thr == [0, 9] == ThresholdPagePolicy(replace(sel, policy="threshold"))(scores, 40, 6).tolist()
    # FlashMemory's default: the threshold's pages and the tail, then pages by summed score, then the newest.
    assert default(scores, 40, 6).tolist() == [0, 2, 5, 7, 8, 9]
