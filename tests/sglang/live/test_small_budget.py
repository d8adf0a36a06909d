"""(c) Path-P + Level 1 + score-resident Level 2 at a small budget (two 64-chunk pages per request, 13-25% of
these histories) with a retriever trained here on this model: concurrent requests of 2K-3.6K tokens that
arrive and finish mid-cycle (tau = 4 decode steps) complete, Level 1 runs and recalls pages beyond the ones an
admitted request starts with, and /metrics shows the FlashMemory counters."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sglang.live.conftest import prompt

REQS = [(3600, 5, 13, 0.0), (2800, 6, 7, 2.0), (2000, 7, 10, 4.0)]  # (tokens, seed, steps, arrival delay s)


def _metric(text: str, name: str, default: float | None = None) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    if not m and default is not None:  # a counter sglang's registry shows only once it has counted
        return default
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def small_run(live_servers):
    """The three requests' outputs and what the counters of the shared small server gained during them (other
    modules' requests run on the same server: its cumulative values count theirs too), with /metrics after."""
    srv = live_servers["small"]
    before = srv.get_text("/metrics")

    def one(n, seed, steps, delay):
        time.sleep(delay)
        return srv.generate(prompt(n, seed), steps)["output_ids"]

    with ThreadPoolExecutor(len(REQS)) as ex:
        outs = list(ex.map(lambda r: one(*r), REQS))
    after = srv.get_text("/metrics")

    def gained(name: str) -> float:
        return _metric(after, name) - _metric(before, name, default=0.0)

    return outs, gained, after


def test_small_budget_completes_with_level1_and_metrics(small_run):
    outs, gained, text = small_run
    assert [len(o) for o in outs] == [r[2] for r in REQS]
    print("\n".join(l for l in text.splitlines() if l.startswith("flashmemory_")))
    assert gained("flashmemory_level1_cycles_total") > 0
    assert 0.0 < _metric(text, "flashmemory_resident_fraction") < 0.3


def test_small_budget_recalls_pages(small_run):
    """Level 1 recalls pages during these requests: more than the admission warm start's (the page before the
    newest, per request), both counted over these requests only."""
    _, gained, _ = small_run
    warm = gained("flashmemory_warm_start_pages_total")
    assert warm > 0 and gained("flashmemory_recall_pages_total") > warm
