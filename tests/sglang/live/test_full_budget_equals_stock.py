"""(b) Path-P + Level 1 + score-resident Level 2 with a budget that holds the whole history: the tokens of
stock sglang. Two requests of different lengths run concurrently on both servers, as each server's first
requests (a fresh server's first decode step once scored only the newest page: Level-2 buffers were allocated
lazily, after the publish)."""

from concurrent.futures import ThreadPoolExecutor

from tests.sglang.live.conftest import prompt

REQS = [(1100, 3, 12), (760, 4, 8)]   # (prompt tokens, seed, decode steps)


def _run(server):
    with ThreadPoolExecutor(len(REQS)) as ex:
        futs = [ex.submit(server.generate, prompt(n, seed), steps) for n, seed, steps in REQS]
        return [f.result()["output_ids"] for f in futs]


def test_full_budget_tokens_equal_stock(live_servers):
    stock, full = live_servers["stock"], live_servers["full"]
    with ThreadPoolExecutor(2) as ex:
        a, b = ex.map(_run, (stock, full))
    assert a == b, (a, b)
    log = full.log.read_text()
    assert "FlashMemory: offload engine attached" in log and "Level-1 side band" in log
