"""Live on CPU: HiSparse with FlashMemory's prefetch, Level 1 as the hint source, behind P and the router.

The stack is `flashmemory serve --hisparse`'s (`stack.hisparse_config`: stock D with --enable-hisparse, KV over
Mooncake TCP) with a 768-slot hot buffer (top-k 512, so a cycle may hint 256 positions per request), D loading
the FlashMemory plugin with SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1 and the folder's trained retriever
(SGLANG_RETRIEVER_INLINE_CKPT, Level 1 every 4 steps). Prompts of 3,600 tokens (900 c4 entries > 768 slots:
every decode step runs the swap-in, not its fast path; within the folder's stock server's 4K context).
Checked: D's greedy tokens equal the plain stock server's for every request (HiSparse stays exact whatever the
hint), Level 1 published hints, prefetches loaded entries into the hot buffer (`flashmemory_hisparse_prefetch_*`
on D's /metrics) and demand swap-ins ran beside them. The weights are random, so whether a hint is later picked
(`used`) says nothing about Level 1's quality; it is printed only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
pytest.importorskip("sglang")
pytest.importorskip(
    "mooncake.engine",
    reason="HiSparse PD on CPU moves KV with Mooncake (TCP): "
    "pip install -e '.[serve-mooncake-cpu]' and the OS package libibverbs1",
)

from flashmemory.serve.client import generate, parse_metrics  # noqa: E402
from flashmemory.serve.procs import Servers, http_get  # noqa: E402
from flashmemory.serve.stack import PDConfig, hisparse_config, start_pd  # noqa: E402
from tests.sglang.live.conftest import STARTUP_S, prompt, side_by_side  # noqa: E402

HOT, TOP_K, PROMPT_LEN, NEW_TOKENS, REQUESTS = 768, 512, 3600, 8, 2


@pytest.fixture(scope="module")
def stack(serving_model, tiny_retriever_ckpt, tmp_path_factory, request):
    knobs = {"MAX_RUN": "2"}
    base = PDConfig(model=Path(serving_model), decode_env=knobs, prefill_env=knobs, startup_timeout=STARTUP_S)
    cfg = hisparse_config(base, HOT, TOP_K)
    cfg = replace(
        cfg,
        decode_env={
            **cfg.decode_env,
            "SGLANG_PLUGINS": "flashmemory_cpu,flashmemory",
            "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "1",
            "CKPT": tiny_retriever_ckpt,
            "INTERVAL": "4",
        },
    )
    logs = tmp_path_factory.mktemp("hisparse_prefetch_logs")
    servers = Servers(logs)
    request.getfixturevalue("stock_server")  # launched beside the stack; waited for at first use
    try:
        yield start_pd(servers, cfg), logs
    finally:
        servers.stop()
        assert not servers.leftovers()


def _prefetch_counters(decode_url: str) -> dict[str, float]:
    status, body = http_get(decode_url + "/metrics", timeout=10)
    assert status == 200, f"{decode_url}/metrics answered {status}"
    out = {}
    for prefix in ("flashmemory_hisparse_prefetch_", "flashmemory_hisparse_swapin_"):
        m = parse_metrics(body.decode(errors="replace"), prefix=prefix)
        out.update(
            {
                prefix.split("_")[2] + "_" + k.removeprefix(prefix).removesuffix("_total"): v
                for k, v in m.items()
                if k.endswith("_total")
            }
        )
    return out


def test_level1_hints_land_in_the_hot_buffer_and_tokens_equal_stock(stack, stock_server):
    pd, logs = stack
    stock = stock_server.wait_ready(STARTUP_S)
    assert PROMPT_LEN // 4 > HOT > TOP_K
    before = _prefetch_counters(pd.decode_url)
    for seed in range(REQUESTS):
        ids = prompt(PROMPT_LEN, 100 + seed)
        want, got = side_by_side(
            lambda ids=ids: generate(stock.url, ids, NEW_TOKENS),
            lambda ids=ids: generate(pd.router_url, ids, NEW_TOKENS),
        )
        assert got == want, f"request {seed}: HiSparse + prefetch D {got} != stock {want}"
    after = _prefetch_counters(pd.decode_url)
    gain = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    print(f"\nHiSparse + Level-1 prefetch, {REQUESTS} x {PROMPT_LEN} tokens, {NEW_TOKENS} new: {gain}")
    assert gain["prefetch_positions"] > 0 and gain["prefetch_loaded"] > 0, gain  # hints published and landed
    assert gain["prefetch_bytes_h2d"] == gain["prefetch_loaded"] * 584, gain
    assert gain["swapin_calls"] > 0 and gain["swapin_misses"] > 0, gain  # demand path still runs
    d_log = (logs / "decode.log").read_text(errors="replace")
    assert "Level 1 is the hint source" in d_log and "'enable_hisparse': True" in d_log
    assert "FlashMemory Path-P" not in d_log
