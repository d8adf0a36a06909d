import os

import pytest

from flashmemory.env_doc import ENV_DOC
from flashmemory.sglang.plumbing.gates import gate_table

pytestmark = pytest.mark.sglang
ROOT = os.path.join(os.path.dirname(__file__), "../../..")


def test_readme_gate_table_is_generated_and_complete():
    text = open(os.path.join(ROOT, "docs/configuration.md")).read()
    assert gate_table() in text, (
        "gate table is stale: regenerate with python -m flashmemory.sglang.plumbing.gates --write FILE"
    )
    for name in ENV_DOC:
        assert f"`{name}`" in text


def test_readme_names_the_router_endpoint():
    for doc in ("README.md", "docs/serving.md"):
        assert "31503/v1/chat/completions" in open(os.path.join(ROOT, doc)).read(), doc


def test_metrics_export():
    prom = pytest.importorskip("prometheus_client")
    from flashmemory.sglang.metrics.prometheus import FlashMemoryMetrics

    reg = prom.CollectorRegistry()
    m = FlashMemoryMetrics.create(registry=reg)
    m.publish({"recall_bytes": 1000, "resident_fraction": 0.25, "unknown": 1})
    m.publish({"recall_bytes": 1500})
    out = prom.generate_latest(reg).decode()
    assert 'flashmemory_recall_bytes_total{attn_tp_rank="0",dp_rank="0"} 1500.0' in out
    assert 'flashmemory_resident_fraction{attn_tp_rank="0",dp_rank="0"} 0.25' in out


def test_readme_metrics_table_is_generated_and_complete():
    """docs/metrics.md's metrics table is `metrics_table()` (regenerate it when a metric is added) and names every
    metric, the serving gauges an operator reads at idle, the guard's failure counter and HiSparse's swap-in
    counters included."""
    from flashmemory.sglang.metrics.prometheus import (
        FAILURES,
        HISPARSE_SWAPIN,
        HISPARSE_SWAPIN_PREFIX,
        METRICS,
        PREFIX,
        SERVING_METRICS,
        metrics_table,
    )

    text = open(os.path.join(ROOT, "docs/metrics.md")).read()
    assert metrics_table() in text, (
        "metrics table is stale: paste flashmemory.sglang.metrics.prometheus.metrics_table()"
    )
    swapin = [HISPARSE_SWAPIN_PREFIX + k for k in HISPARSE_SWAPIN]
    for key in (*METRICS, *SERVING_METRICS, FAILURES[0], *swapin):
        assert f"`{PREFIX}{key}" in text, key
    for gauge in ("live_requests", "free_reserve_blocks", "reserve_blocks", "host_mirror_bytes_in_use"):
        assert gauge in SERVING_METRICS


def test_serving_gauges_and_failure_counter_export():
    prom = pytest.importorskip("prometheus_client")
    from flashmemory.sglang.metrics.prometheus import FlashMemoryMetrics, failure_counter

    reg = prom.CollectorRegistry()
    m = FlashMemoryMetrics.create(registry=reg)
    m.publish({"live_requests": 0, "free_reserve_blocks": 96, "reserve_blocks": 96, "host_mirror_bytes_in_use": 0})
    failure_counter(registry=reg).labels(hook="before_forward", dp_rank="0", attn_tp_rank="0").inc()
    out = prom.generate_latest(reg).decode()
    ranks = '{attn_tp_rank="0",dp_rank="0"}'
    assert f"flashmemory_free_reserve_blocks{ranks} 96.0" in out and f"flashmemory_live_requests{ranks} 0.0" in out
    assert 'flashmemory_request_failures_total{attn_tp_rank="0",dp_rank="0",hook="before_forward"} 1.0' in out


def test_hisparse_swapin_table_rows_are_the_counters_the_cpu_layer_exports():
    """The metrics table's HiSparse rows name exactly the counters `SwapInCounter` creates, in its order."""
    from flashmemory.sglang.cpu.hisparse_record import SwapInCounter
    from flashmemory.sglang.metrics.prometheus import HISPARSE_SWAPIN

    assert tuple(HISPARSE_SWAPIN) == SwapInCounter.KEYS


def test_hisparse_prefetch_table_rows_are_the_counters_the_mode_exports():
    """The metrics table names every counter `PrefetchCounter` creates, in its order."""
    from flashmemory.sglang.hisparse.state import PrefetchCounter
    from flashmemory.sglang.metrics.prometheus import HISPARSE_PREFETCH, HISPARSE_PREFETCH_PREFIX, PREFIX, metrics_table

    assert tuple(HISPARSE_PREFETCH) == PrefetchCounter.KEYS
    for k in HISPARSE_PREFETCH:
        assert f"`{PREFIX}{HISPARSE_PREFETCH_PREFIX}{k}_total`" in metrics_table()
