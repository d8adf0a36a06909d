"""(c) Path-P + Level 1 + score-resident Level 2 at a small budget (one 64-chunk page per request plus a
16-chunk tail) with a retriever trained here on this model: concurrent requests of different lengths that
arrive and finish mid-cycle (tau = 4 decode steps) complete, Level 1 runs, pages are recalled, and /metrics
shows the FlashMemory counters."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

from tests.sglang.live.conftest import prompt

REQS = [(1100, 5, 13, 0.0), (900, 6, 7, 2.0), (700, 7, 10, 4.0)]  # (tokens, seed, steps, arrival delay s)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_small_budget_recalls_and_exports_metrics(live_servers):
    srv = live_servers["small"]

    def one(n, seed, steps, delay):
        time.sleep(delay)
        return srv.generate(prompt(n, seed), steps)["output_ids"]

    with ThreadPoolExecutor(len(REQS)) as ex:
        outs = list(ex.map(lambda r: one(*r), REQS))
    assert [len(o) for o in outs] == [r[2] for r in REQS]
    text = srv.get_text("/metrics")
    print("\n".join(l for l in text.splitlines() if l.startswith("flashmemory_")))
    cycles = _metric(text, "flashmemory_level1_cycles_total")
    pages = _metric(text, "flashmemory_recall_pages_total")
    resident = _metric(text, "flashmemory_resident_fraction")
    assert cycles > 0 and pages > 0, (cycles, pages)
    assert 0.0 < resident < 1.0, resident
    print(f"level1_cycles={cycles} recall_pages={pages} resident_fraction={resident}")
