"""(a) Stock sglang on CPU and sglang with the FlashMemory plugin loaded but every gate off: identical tokens.

"Stock" loads only the CPU layer (SGLANG_PLUGINS=flashmemory_cpu): the FlashMemory plugin is not imported.
"""

from tests.sglang.live.conftest import prompt, side_by_side

STEPS = 6


def test_gates_off_tokens_equal_stock(live_servers):
    stock, off = live_servers["stock"], live_servers["off"]
    ids = prompt(700, 1)
    a, b = side_by_side(
        lambda: stock.generate(ids, STEPS)["output_ids"], lambda: off.generate(ids, STEPS)["output_ids"]
    )
    # Exact, not tie-tolerant: with every gate off both servers run stock sglang's kernels on the same single-request
    # batches, so they compute the same bits and every top-k (indexer, gate, greedy) resolves alike.
    assert len(a) == STEPS and a == b, (a, b)
    # Both ran on the CPU layer's torch sparse decode, neither attached the FlashMemory engine, and both forked
    # sglang's subprocesses (the CPU layer's start method: patches_runtime.fork_children).
    for srv in (stock, off):
        log = srv.log.read_text()
        assert "offload engine attached" not in log
        assert "scheduler and detokenizer start by fork" in log
    # The comparison means something only if the gates-off server did load the FlashMemory plugin (and found every
    # gate off) while the stock one did not: `plugin.register` says which in the server's log.
    assert "FlashMemory: all gates off; no hooks registered" in off.log.read_text()
    assert "FlashMemory: all gates off" not in stock.log.read_text()
    assert "FlashMemory: active features" not in off.log.read_text() + stock.log.read_text()
