import os

import pytest

from flashmemory.env import ENV_DOC
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
