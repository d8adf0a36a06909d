"""Issue 14 on the live CPU server: with SGLANG_RETRIEVER_MISS_MONITOR=1 at a small budget the miss monitor
runs inside sglang (the native query recomputed by sglang's own C4 indexer on the CPU layer) and its counters
and histogram appear on /metrics."""

import re

import pytest

from tests.sglang.live.conftest import SMALL_BUDGET, make_server, prompt

MONITOR = {**SMALL_BUDGET, "SGLANG_RETRIEVER_MISS_MONITOR": "1"}


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def monitored(serving_model, live_logs, tiny_retriever_ckpt):
    srv = make_server(serving_model, live_logs, "monitor", env={**MONITOR, "SGLANG_RETRIEVER_INLINE_CKPT": tiny_retriever_ckpt})
    try:
        srv.wait_ready(600)
        outs = [srv.generate(prompt(n, seed), steps)["output_ids"] for n, seed, steps in [(900, 11, 12), (600, 12, 9)]]
        yield outs, srv.get_text("/metrics")
    finally:
        srv.stop()
    assert srv.leftovers() == []


def test_monitor_counters_on_metrics(monitored):
    outs, text = monitored
    assert [len(o) for o in outs] == [12, 9]
    print("\n".join(l for l in text.splitlines() if l.startswith("flashmemory_")))
    assert _metric(text, "flashmemory_level1_cycles_total") > 0
    assert _metric(text, "flashmemory_monitor_cycles_total") > 0
    assert re.search(r"^flashmemory_miss_mass_bucket\{", text, re.M), "miss-mass histogram missing from /metrics"
    for name in ("flashmemory_escalations_total", "flashmemory_fallbacks_total", "flashmemory_budget_pages_mean"):
        _metric(text, name)
