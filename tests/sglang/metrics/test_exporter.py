"""The metrics export runs off the decode thread and reads running totals, never a scan.

Decode steps run through sglang's hooks (copy mode, a fake pool with sglang's page layout) with prometheus metrics,
the diagnostics file and a Level-1 cycle every step on; requests join and leave. Every public verb of the core is
recorded when the decode thread calls it: none of the export's reads (the per-request scan `metrics`, the lookup
table read `cells`, `totals`, `occupancy`, `recent_misses`) and no `OffloadAdapter.stats` happen there. The export
then runs on another thread and publishes what the old scan computes."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from flashmemory.sglang.decode import hooks
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.metrics.exporter import MetricsExporter
from tests.sglang.decode.test_step_crossings import SEQ, Recorder, _step
from tests.sglang.decode.test_step_crossings import served as served  # noqa: F401  (the fixture)

RANKS = {"dp_rank": "0", "attn_tp_rank": "0"}  # the one scheduler of a server without attention DP or TP

pytestmark = pytest.mark.sglang
prom = pytest.importorskip("prometheus_client")
EXPORT_READS = {"engine.metrics", "engine.cells", "engine.totals", "engine.occupancy", "engine.recent_misses"}


def _scan_stats(adapter) -> dict[str, float]:
    """resident_fraction and the counters as the export computed them before: a scan of every request."""
    snap = adapter.engine.metrics()["total"]
    hist = sum(n for _, n in adapter.engine.snapshot_rows().values())
    return {
        "resident_fraction": snap["resident_chunks"] / hist if hist else 0.0,
        "recall_pages": float(snap["recall_pages"]),
        "level1_cycles": float(snap["cycles"]),
    }


@pytest.fixture
def exported(served, monkeypatch, tmp_path):  # noqa: F811
    from flashmemory.sglang.metrics.prometheus import FlashMemoryMetrics

    reg = prom.CollectorRegistry()
    monkeypatch.setattr(RUNTIME, "metrics", FlashMemoryMetrics.create(registry=reg))
    monkeypatch.setattr(RUNTIME, "diag_path", str(tmp_path / "stats.json"))
    monkeypatch.setattr(RUNTIME, "exporter", MetricsExporter(RUNTIME.export))  # not started: flushed below
    served.reg, served.diag = reg, tmp_path / "stats.json"
    return served


def test_decode_steps_read_no_metrics_and_the_export_thread_publishes_the_scan(exported):
    s = exported
    rec = Recorder()
    rec.wrap(s.adapter.engine, "engine")
    stats_calls: list[str] = []
    inner = s.adapter.stats
    s.adapter.stats = lambda: (stats_calls.append(threading.current_thread().name), inner())[1]
    seq = SEQ + 1
    for rids in (["a"], ["a"], ["a", "b"], ["a", "b"], ["a", "b"], ["b"], ["b"]):  # b joins, a leaves
        _step(s, rids, seq)
        seq += 1
    decode = threading.current_thread().name
    assert not EXPORT_READS & set(rec.verbs()), rec.verbs()
    assert decode not in stats_calls and RUNTIME.exporter.exports == 0  # only marked due
    assert not s.diag.exists()
    worker = threading.Thread(target=RUNTIME.exporter.flush, name="exporter")
    worker.start()
    worker.join()
    assert set(stats_calls) == {"exporter"} and RUNTIME.exporter.exports == 1
    want = _scan_stats(s.adapter)
    assert want["resident_fraction"] > 0 and want["level1_cycles"] > 0
    got = {k: s.reg.get_sample_value("flashmemory_" + k, RANKS) for k in ("resident_fraction",)}
    got.update({k: s.reg.get_sample_value(f"flashmemory_{k}_total", RANKS) for k in ("recall_pages", "level1_cycles")})
    assert got == pytest.approx(want)
    assert s.reg.get_sample_value("flashmemory_live_requests", RANKS) == 1.0
    diag = json.loads(s.diag.read_text())
    assert diag["decode_forwards"] == 7 and diag["resident_fraction"] == pytest.approx(want["resident_fraction"])


def test_the_exporter_thread_runs_kicks_and_coalesces_them():
    done = threading.Event()
    fulls: list[bool] = []

    def work(full: bool) -> None:
        fulls.append(full)
        done.set()

    ex = MetricsExporter(work)
    for full in (False, True, False):  # three decode steps before the thread runs: one export, a full one
        ex.kick(full)
    ex.start()
    try:
        assert done.wait(10)
    finally:
        ex.close()
    assert fulls == [True] and ex.exports == 1 and not ex.flush()


def test_idle_publishes_at_once(exported):
    s = exported
    _step(s, ["a"], SEQ + 1)
    idle = type("Sched", (), {"running_batch": None, "last_batch": None, "result_queue": []})()
    hooks.after_on_idle(None, idle)
    assert s.reg.get_sample_value("flashmemory_live_requests", RANKS) == 0.0 and RUNTIME.exporter.exports == 1
    assert torch.equal(torch.tensor(s.reg.get_sample_value("flashmemory_resident_fraction", RANKS)), torch.tensor(0.0))
