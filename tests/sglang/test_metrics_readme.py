import os

import pytest

from flashmemory.env_doc import ENV_DOC
from flashmemory.sglang.gates import gate_table

pytestmark = pytest.mark.sglang
README = os.path.join(os.path.dirname(__file__), "../../flashmemory/sglang/README.md")


@pytest.mark.parametrize("readme", [README, os.path.join(os.path.dirname(__file__), "../../README.md")])
def test_readme_gate_table_is_generated_and_complete(readme):
    text = open(readme).read()
    assert gate_table() in text, "README gate table is stale: regenerate with python -m flashmemory.sglang.gates"
    for name in ENV_DOC:
        assert f"`{name}`" in text
    assert "31503/v1/chat/completions" in text


def test_metrics_export():
    prom = pytest.importorskip("prometheus_client")
    from flashmemory.sglang.prometheus import FlashMemoryMetrics
    reg = prom.CollectorRegistry()
    m = FlashMemoryMetrics.create(registry=reg)
    m.publish({"recall_bytes": 1000, "resident_fraction": 0.25, "unknown": 1})
    m.publish({"recall_bytes": 1500})
    out = prom.generate_latest(reg).decode()
    assert "flashmemory_recall_bytes_total 1500.0" in out and "flashmemory_resident_fraction 0.25" in out


def test_readme_metrics_table_is_generated_and_complete():
    """The README's metrics table is `metrics_table()` (regenerate it when a metric is added) and names every metric,
    the serving gauges an operator reads at idle and the guard's failure counter included."""
    from flashmemory.sglang.prometheus import FAILURES, METRICS, PREFIX, SERVING_METRICS, metrics_table
    text = open(os.path.join(os.path.dirname(__file__), "../../README.md")).read()
    assert metrics_table() in text, "README metrics table is stale: paste flashmemory.sglang.prometheus.metrics_table()"
    for key in (*METRICS, *SERVING_METRICS, FAILURES[0]):
        assert f"`{PREFIX}{key}" in text, key
    for gauge in ("live_requests", "free_reserve_blocks", "reserve_blocks", "host_mirror_bytes_in_use"):
        assert gauge in SERVING_METRICS


def test_serving_gauges_and_failure_counter_export():
    prom = pytest.importorskip("prometheus_client")
    from flashmemory.sglang.prometheus import FlashMemoryMetrics, failure_counter
    reg = prom.CollectorRegistry()
    m = FlashMemoryMetrics.create(registry=reg)
    m.publish({"live_requests": 0, "free_reserve_blocks": 96, "reserve_blocks": 96, "host_mirror_bytes_in_use": 0})
    failure_counter(registry=reg).labels(hook="before_forward").inc()
    out = prom.generate_latest(reg).decode()
    assert "flashmemory_free_reserve_blocks 96.0" in out and "flashmemory_live_requests 0.0" in out
    assert 'flashmemory_request_failures_total{hook="before_forward"} 1.0' in out
