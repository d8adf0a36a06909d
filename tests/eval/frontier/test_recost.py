"""A frontier record's HiSparse costs: each arm charged its own swap-in misses (`Sweep._record`), and `--recost`
recomputing them from a stored record's per-arm stats (`eval.frontier.recost`). No model runs here: the record
is built by `Sweep._record` from a stand-in run whose two HiSparse arms miss differently."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashmemory.eval.frontier import run as fr
from flashmemory.eval.frontier.cost import KV_BYTES

N_C4, N_FINAL, T, CB = 3, 80, 4, 68  # c4 layers, chunks, decode steps, stored index-key bytes
MISSES = {"HiSparse": 10.0, "HiSparse+prefetch": 3.0}  # the prefetch arm misses less and prefetches 5 entries
PREFETCHED = 5.0


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
    return fr.Sweep._record(sweep, run, SimpleNamespace(forced_forwards=0), per_budget)


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
