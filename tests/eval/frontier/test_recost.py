"""A frontier record's HiSparse costs: each arm charged its own swap-in misses (`Sweep._record`), and `--recost`
recomputing them from a stored record's per-arm stats (`eval.frontier.recost`). No model runs here: the record
is built by `Sweep._record` from a stand-in run whose two HiSparse arms miss differently."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashmemory.cli import main
from flashmemory.errors import UserError
from flashmemory.eval.frontier import run as fr
from flashmemory.eval.frontier.cost import KV_BYTES
from flashmemory.eval.frontier.recost import COST_REV, needs_recost, recost_record

N_C4, N_FINAL, T, CB = 3, 80, 4, 68  # c4 layers, chunks, decode steps, stored index-key bytes
MISSES = {"HiSparse": 10.0, "HiSparse+prefetch": 3.0}  # the prefetch arm misses less and prefetches 5 entries
PREFETCHED = 5.0
RECORD = fr.Sweep._record  # the real record builder (the run tests replace fr.Sweep)


def _stats(run, slots: int, hint=None) -> dict:
    """hisparse_stats stand-in: 10 misses alone, 3 with the hint (which prefetches 5), summed over layers."""
    arm = "HiSparse" if hint is None else "HiSparse+prefetch"
    out = {
        "hits": 20.0,
        "misses": MISSES[arm],
        "hit_rate": 0.5,
        "fast_path_calls": 0.0,
        "calls": float(N_C4 * T),  # one call per c4 layer and decode step
    }
    return out | ({"prefetched": PREFETCHED, "prefetch_hits": 2.0, "prefetch_wasted": 1.0} if hint else {})


def _body(fc: fr.FrontierConfig) -> dict:
    """The record body `Sweep._record` writes for a stand-in document (no model)."""
    sweep = SimpleNamespace(
        fc=fc, engine=SimpleNamespace(index_topk=16), targets=(0, 1, 2), _l1=lambda *a: 1000.0, shapes=()
    )
    run = SimpleNamespace(index_chunks=torch.zeros(N_C4, N_FINAL, CB), n_steps=T, prompt_len=316)
    per_budget = {}
    for b in fc.budgets:
        full = {"task_score": 1.0, "agreement": 1.0, "mass": 1.0, "golden_recall": 1.0, "resident_frac": 1.0}
        rows = {
            "Full": full | {"recall_bytes": 0.0, "kmax": 2},
            "FlashMemory": {"task_score": 1.0, "kmax": 2, "recall_bytes": 400.0, "resident_frac": 0.2},
        }
        per_budget[b] = (rows, {"FlashMemory": torch.zeros(T, N_FINAL, dtype=torch.bool)})
    return RECORD(sweep, run, SimpleNamespace(forced_forwards=0), per_budget)


@pytest.fixture
def fc(tmp_path, monkeypatch):
    monkeypatch.setattr(fr, "hisparse_stats", _stats)
    ck = tmp_path / "r.safetensors"
    ck.write_bytes(b"weights")
    return fr.FrontierConfig(
        out_dir=str(tmp_path / "out"),
        retriever=str(ck),
        n_per_task=1,
        budgets=(0.1, 0.5),
        tasks=("mqar", "niah_single"),
        methods=("FlashMemory",),
    )


def test_each_hisparse_arm_is_charged_its_own_misses(fc):
    rows = _body(fc)["budgets"]["0.1"]
    assert rows["HiSparse"]["misses"] == 10.0 and rows["HiSparse+prefetch"]["misses"] == 3.0
    assert rows["HiSparse"]["h2d_per_token"] == 10.0 * KV_BYTES / T  # not the prefetch arm's 3 misses
    assert rows["HiSparse+prefetch"]["h2d_per_token"] == (3.0 + PREFETCHED) * KV_BYTES / T
    assert rows["Full"]["h2d_per_token"] == 0.0 and rows["FlashMemory"]["h2d_per_token"] == 400.0 / T


def _older(rec: dict) -> dict:
    """`rec` as a record of the older cost revision writes it: no cost_rev, and plain HiSparse charged the
    misses of the last arm replayed (HiSparse+prefetch's)."""
    old = json.loads(json.dumps(rec))
    old.pop("cost_rev")
    for rows in old["budgets"].values():
        rows["HiSparse"]["h2d_per_token"] = rows["HiSparse+prefetch"]["misses"] * KV_BYTES / T
    return old


def _record(fc: fr.FrontierConfig, i: int = 8) -> dict:
    return {"format": fr.FORMAT, "fingerprint": "f", "index": i, "task": "mqar", "seconds": 1.0} | _body(fc)


def test_recost_gives_each_arm_its_own_misses_from_the_stored_stats(fc, tmp_path):
    rec = _record(fc)
    assert rec["cost_rev"] == COST_REV and not needs_recost(rec)
    old = _older(rec)
    assert needs_recost(old) and old["budgets"]["0.1"]["HiSparse"]["h2d_per_token"] == 3.0 * KV_BYTES / T
    new = recost_record(tmp_path / "00008.json", old)
    assert new["budgets"] == rec["budgets"]  # every row and field as the fixed sweep writes it
    assert new["cost_rev"] == COST_REV and new["recosted"] is True and "cost_rev" not in old
    no_prefetch = json.loads(json.dumps(old))
    for rows in no_prefetch["budgets"].values():
        del rows["HiSparse+prefetch"]
    assert not needs_recost(no_prefetch)  # one arm only: the last arm was its own


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m.update(hot_slots=m["hot_slots"] + 1), "budgets.0.1.HiSparse.device_bytes"),
        (lambda m: m.pop("calls"), "budgets.0.1.HiSparse.calls"),
        (lambda m: m.update(calls=7.0), "budgets.0.1.HiSparse.calls"),
        (lambda m: m.update(misses=None), "budgets.0.1.HiSparse.misses"),
    ],
)
def test_recost_refuses_a_record_whose_costs_do_not_follow_from_its_stats(fc, tmp_path, edit, field):
    old = _older(_record(fc))
    edit(old["budgets"]["0.1"]["HiSparse"])
    path = tmp_path / "00008.json"
    with pytest.raises(UserError) as e:
        recost_record(path, old)
    assert str(e.value).startswith(f"{path}: field {field}") and "\n" not in str(e.value)


class RecordSweep:
    """Stands in for the model pass with `Sweep._record`'s body of the stand-in document."""

    def __init__(self, fc):
        self.fc = fc

    def doc(self, i: int, task: str) -> dict:
        return _body(self.fc)


def test_a_run_refuses_older_costs_until_recost_recomputes_them(fc, monkeypatch, capsys):
    monkeypatch.setattr(fr, "Sweep", RecordSweep)
    res = fr.run_frontier(fc, log=lambda s: None, progress=False)
    own = res["methods"]["0.1"]["HiSparse"]["h2d_per_token"]
    assert own == 10.0 * KV_BYTES / T
    docs = Path(fc.out_dir) / "docs"
    first, second = docs / "00008.json", docs / "00009.json"
    first.write_text(json.dumps(_older(json.loads(first.read_text()))))
    kept = second.read_bytes()
    with pytest.raises(UserError, match=r"00008\.json: field cost_rev: .*--recost"):
        fr.run_frontier(fc, log=lambda s: None, progress=False, report_only=True)
    argv = ["eval", "frontier", "--out", fc.out_dir, "--retriever", fc.retriever, "--n-per-task", "1"]
    argv += ["--budgets", "0.1,0.5", "--tasks", "mqar,niah_single", "--methods", "FlashMemory", "--no-progress"]
    assert main(argv + ["--recost"]) == 0
    assert "--recost: 1 of 2 records' HiSparse costs recomputed" in capsys.readouterr().out
    rec = json.loads(first.read_text())
    assert rec["recosted"] is True and rec["cost_rev"] == COST_REV and second.read_bytes() == kept
    res = json.loads((Path(fc.out_dir) / "frontier.json").read_text())
    assert res["methods"]["0.1"]["HiSparse"]["h2d_per_token"] == own
    md = (Path(fc.out_dir) / "frontier.md").read_text()
    assert "HiSparse costs recomputed from the stored per-arm stats (`--recost`) in 1 of 2 records" in md
    before = first.read_bytes()
    assert main(argv + ["--recost"]) == 0 and first.read_bytes() == before  # nothing left to recompute
    assert main(argv) == 0  # and a plain run reports again
