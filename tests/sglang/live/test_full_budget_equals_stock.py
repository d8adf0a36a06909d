"""(b) Path-P + Level 1 + score-resident Level 2 at a budget that holds the whole history: stock sglang's tokens,
with Level 1 deciding what is resident (every chunk passes it; the recency tail is 16 chunks), more decode steps
than 2 x tau (tau = 4), and four concurrent requests of different lengths.

Why one batched /generate call: stock sglang on CPU is not batch-invariant. The same request decoded alone and
beside three others gave logprobs up to 0.65 apart and other greedy tokens after 4-22 steps (and two concurrent
runs of one stock server differed once, when the arrival order changed the batches), so two servers fed by
separate HTTP threads can legitimately disagree. One call hands the scheduler all four at once, on both servers.
Why one request past 512 chunks (2,700 tokens = 675 chunks): beyond the indexer's top-512 the picks among tied
scores depend on the width of the logits sglang hands to top-k; the score-resident view now has the full table's
width, so it picks exactly what stock picks (a narrower view flipped a token at step 20 of such a request)."""

from tests.sglang.live.conftest import prompt, side_by_side

REQS = [(300, 3), (700, 4), (1900, 6), (2700, 7)]  # (prompt tokens, seed): 75 to 675 chunks, 2 to 11 pages
STEPS = 16  # > 2 x SGLANG_RETRIEVER_INTERVAL (4): Level-1 cycles decide


def _batched(server) -> list[list[int]]:
    body = {
        "input_ids": [prompt(n, seed) for n, seed in REQS],
        "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True},
    }
    return [r["output_ids"] for r in server.post("/generate", body, 1800)]


def _counter(server, name: str) -> float:
    from flashmemory.serve.client import parse_metrics

    return parse_metrics(server.get_text("/metrics"), prefix=name).get(name, 0.0)


def test_full_budget_tokens_equal_stock_under_level1_cycles(live_servers):
    stock, full = live_servers["stock"], live_servers["full"]
    cycles0 = _counter(full, "flashmemory_level1_cycles_total")
    a, b = side_by_side(lambda: _batched(stock), lambda: _batched(full))
    assert [len(x) for x in b] == [STEPS] * len(REQS)
    # Exact, not tie-tolerant: at full budget the score-resident view is the full table (same scorer inputs and
    # width) and the sparse decode reads the same KV bytes from reserve cells in the same pick order, in the same
    # batches: the same bits as stock, so every top-k (indexer, MoE gate, greedy) resolves alike, ties included.
    diff = [(i, next(k for k in range(STEPS) if x[k] != y[k])) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    assert not diff, f"(request, first differing step): {diff}; stock {a}; full {b}"
    assert _counter(full, "flashmemory_level1_cycles_total") >= cycles0 + 2, "Level 1 did not cycle"
    log = full.log.read_text()
    assert "FlashMemory: offload engine attached" in log and "Level-1 side band" in log
