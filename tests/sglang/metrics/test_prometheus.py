"""FlashMemory's Prometheus series per scheduler: under attention data parallelism each DP rank's scheduler exports
its own requests' counters and gauges, and sglang's multiprocess collector (what /metrics serves) keeps them apart
instead of summing the counters and keeping one rank's gauges."""

import subprocess
import sys
import types

import pytest

from flashmemory.sglang.metrics.prometheus import RANK_LABELS, FlashMemoryMetrics, scheduler_ranks

pytestmark = pytest.mark.sglang
pytest.importorskip("prometheus_client")

# One scheduler process: its DP rank's stats published into the shared multiprocess directory (argv: dir, dp rank,
# Level-1 cycles, resident fraction), as a scheduler of an --attn-dp-size 2 server does.
SCHEDULER = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from flashmemory.sglang.metrics.prometheus import FlashMemoryMetrics
m = FlashMemoryMetrics.create(ranks={"dp_rank": sys.argv[2], "attn_tp_rank": "0"})
m.publish({"level1_cycles": float(sys.argv[3]), "resident_fraction": float(sys.argv[4]), "live_requests": 1.0})
"""


def test_each_dp_rank_has_its_own_series_in_the_multiprocess_collector(tmp_path):
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    for dp, cycles, frac in (("0", 3, 0.25), ("1", 5, 0.75)):
        subprocess.run([sys.executable, "-c", SCHEDULER, str(tmp_path), dp, str(cycles), str(frac)], check=True)
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    value = lambda name, dp: reg.get_sample_value(name, {"dp_rank": dp, "attn_tp_rank": "0"})  # noqa: E731
    assert [value("flashmemory_level1_cycles_total", dp) for dp in "01"] == [3.0, 5.0]  # not one series of 8
    assert [value("flashmemory_resident_fraction", dp) for dp in "01"] == [0.25, 0.75]  # not the last writer's
    assert [value("flashmemory_live_requests", dp) for dp in "01"] == [1.0, 1.0]


def test_every_series_carries_the_rank_labels():
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    FlashMemoryMetrics.create(reg, ranks={"dp_rank": "1", "attn_tp_rank": "0"}).publish({"recall_pages": 2.0})
    samples = [s for fam in reg.collect() if fam.name.startswith("flashmemory_") for s in fam.samples]
    assert samples and all({"dp_rank": "1", "attn_tp_rank": "0"}.items() <= s.labels.items() for s in samples)
    assert reg.get_sample_value("flashmemory_recall_pages_total", {"dp_rank": "1", "attn_tp_rank": "0"}) == 2.0


def parallel(**fields) -> types.ModuleType:
    """A stand-in for sglang.srt.runtime_context whose get_parallel() holds `fields`; an absent one raises as
    sglang's does before its ranks are published."""

    class Parallel:
        def __getattr__(self, name):
            if name in fields:
                return fields[name]
            raise RuntimeError(f"parallel name {name!r} has not been written in this process")

    mod = types.ModuleType("sglang.srt.runtime_context")
    mod.get_parallel = Parallel
    return mod


@pytest.mark.parametrize(
    "fields, want",
    [
        (dict(attn_dp_enabled=True, attn_dp_rank=1, attn_tp_rank=0), ("1", "0")),  # --tp 2 --attn-dp-size 2, rank 1
        (dict(attn_dp_enabled=True, attn_dp_rank=1, attn_tp_rank=1), ("1", "1")),  # --tp 4 --attn-dp-size 2, rank 3
        (dict(attn_dp_enabled=False, attn_dp_rank=0, attn_tp_rank=1), ("0", "1")),  # --tp 2, rank 1
        ({}, ("0", "0")),  # not published yet (outside a scheduler)
    ],
)
def test_scheduler_ranks_read_sglangs_parallel_context(fields, want, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", parallel(**fields))
    assert tuple(scheduler_ranks()[k] for k in RANK_LABELS) == want


def test_the_guard_and_hisparse_counters_carry_the_rank_labels(monkeypatch):
    """The guard's failure counter and the HiSparse swap-in and prefetch counters are one series per scheduler too,
    labelled from sglang's parallel context where they count (DP rank 1 here), as the code that serves makes them."""
    import prometheus_client
    from prometheus_client import CollectorRegistry

    from flashmemory.sglang.cpu.hisparse_record import SwapInCounter
    from flashmemory.sglang.cpu.ops.hisparse import SwapInCounts
    from flashmemory.sglang.decode.guard import Guard
    from flashmemory.sglang.hisparse.state import PrefetchCounter
    from flashmemory.sglang.metrics.prometheus import failure_counter

    reg = CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", reg)  # the counters' default registry, this test's own
    ctx = parallel(attn_dp_enabled=True, attn_dp_rank=1, attn_tp_rank=0)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", ctx)
    guard = Guard()
    guard.counter = failure_counter(reg)
    guard.fail("r1", "before_forward", "test")
    SwapInCounter().add(SwapInCounts(lookups=4, hits=3, misses=1, bytes_h2d=584))
    PrefetchCounter().add(calls=1, loaded=2)
    ranks = {"dp_rank": "1", "attn_tp_rank": "0"}
    got = lambda name, **labels: reg.get_sample_value(name, {**ranks, **labels})  # noqa: E731
    assert got("flashmemory_request_failures_total", hook="before_forward") == 1.0
    assert got("flashmemory_hisparse_swapin_misses_total") == 1.0 and got("flashmemory_hisparse_swapin_calls_total")
    assert got("flashmemory_hisparse_prefetch_loaded_total") == 2.0
    samples = [s for fam in reg.collect() for s in fam.samples if s.name.endswith("_total")]
    assert len(samples) >= 3 and all(ranks.items() <= s.labels.items() for s in samples)
