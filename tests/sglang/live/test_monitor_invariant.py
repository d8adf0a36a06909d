"""Issue 20 on the live CPU server: the miss monitor's readings obey the replay's invariant.

Every reading is 1 - the monitored layer's native top-k mass over the resident set the decode step attended. At
the full budget (KMAX 16 pages of 64 chunks and a 2048-chunk recency tail hold every chunk of these <= 1K-token
requests, from admission on: serving opens the tail page and warm-starts before the first forward) the attended
set is the whole history, so every reading must be 0: all of /metrics' miss-mass histogram in its first bucket
(<= 0.01) and its sum 0. A reading taken against a set no step attended (the empty set the replay once
measured at its first cycle: issue 20) reads 1.0 and fails this.
"""

import re

import pytest

from tests.sglang.live.conftest import FULL_BUDGET, make_server, prompt

MONITOR = {**FULL_BUDGET, "SGLANG_RETRIEVER_MISS_MONITOR": "1"}


def _sample(text: str, name: str, label: str = "") -> float:
    """The value of the /metrics sample `name` (whose labels contain `label`, if given)."""
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and label in (m.group(1) or ""):
            return float(m.group(2))
    raise AssertionError(f"{name} {label} missing from /metrics")


@pytest.fixture(scope="module")
def monitored_full(serving_model, live_logs, tiny_retriever_ckpt):
    srv = make_server(serving_model, live_logs, "monitor_full",
                      env={**MONITOR, "SGLANG_RETRIEVER_INLINE_CKPT": tiny_retriever_ckpt})
    try:
        srv.wait_ready(600)
        outs = [srv.generate(prompt(n, seed), steps)["output_ids"] for n, seed, steps in [(900, 21, 12), (500, 22, 9)]]
        yield outs, srv.get_text("/metrics")
    finally:
        srv.stop()
    assert srv.leftovers() == []


def test_every_live_reading_at_the_full_budget_is_zero(monitored_full):
    outs, text = monitored_full
    assert [len(o) for o in outs] == [12, 9]
    count = _sample(text, "flashmemory_miss_mass_count")
    assert count >= 2, "the monitor took no reading: the invariant would hold vacuously"
    assert _sample(text, "flashmemory_miss_mass_bucket", 'le="0.01"') == count, \
        "a live reading above 0.01 with every chunk resident: it was not taken against the attended set"
    assert _sample(text, "flashmemory_miss_mass_sum") == pytest.approx(0.0, abs=1e-6)
    assert _sample(text, "flashmemory_escalations_total") == 0.0
