"""The miss monitor inside sglang, on the folder's full-budget server (`live_servers["full"]`, which runs with
SGLANG_RETRIEVER_MISS_MONITOR=1): the native query is recomputed by sglang's own C4 indexer on the CPU layer.

- its counters and histogram appear on /metrics, and Level 1 and the monitor both cycle.
- every reading is 1 - the monitored layer's native top-k mass over the resident set the decode step
  attended. At the full budget (KMAX 16 pages of 64 chunks, every chunk passing Level 1) the attended set is the
  whole history, so every reading must be 0: all of the miss-mass histogram in its first bucket (<= 0.01) and
  its sum 0. A reading taken against a set no step attended (the empty set the replay once measured at its first
  cycle) reads 1.0 and fails this. The counters are cumulative over the server's life, so the other tests'
  requests on this server are held to the same invariant.
The monitor does not change tokens: test_full_budget_equals_stock runs on this same server.
"""

import re

import pytest

from tests.sglang.live.conftest import prompt

REQS = [(900, 21, 12), (500, 22, 9)]  # (prompt tokens, seed, decode steps)


def _sample(text: str, name: str, label: str = "") -> float:
    """The value of the /metrics sample `name` (whose labels contain `label`, if given)."""
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and label in (m.group(1) or ""):
            return float(m.group(2))
    raise AssertionError(f"{name} {label} missing from /metrics")


@pytest.fixture(scope="module")
def monitored(live_servers):
    srv = live_servers["full"]
    outs = [srv.generate(prompt(n, seed), steps)["output_ids"] for n, seed, steps in REQS]
    return outs, srv.get_text("/metrics")


def test_monitor_counters_on_metrics(monitored):
    outs, text = monitored
    assert [len(o) for o in outs] == [r[2] for r in REQS]
    print("\n".join(l for l in text.splitlines() if l.startswith("flashmemory_")))
    assert _sample(text, "flashmemory_level1_cycles_total") > 0
    assert _sample(text, "flashmemory_monitor_cycles_total") > 0
    assert re.search(r"^flashmemory_miss_mass_bucket\{", text, re.M), "miss-mass histogram missing from /metrics"
    for name in ("flashmemory_escalations_total", "flashmemory_fallbacks_total", "flashmemory_budget_pages_mean"):
        _sample(text, name)


def test_every_live_reading_at_the_full_budget_is_zero(monitored):
    _, text = monitored
    count = _sample(text, "flashmemory_miss_mass_count")
    assert count >= 2, "the monitor took no reading: the invariant would hold vacuously"
    assert _sample(text, "flashmemory_miss_mass_bucket", 'le="0.01"') == count, (
        "a live reading above 0.01 with every chunk resident: it was not taken against the attended set"
    )
    assert _sample(text, "flashmemory_miss_mass_sum") == pytest.approx(0.0, abs=1e-6)
    assert _sample(text, "flashmemory_escalations_total") == 0.0
