"""On the live CPU server, a layout FlashMemory does not serve stops start-up: sglang's attention-DP recipe
(`--tp 2 --attn-dp-size 2`, two DP ranks of one rank each) with Path-P on ends with the one refusal line from the
scheduler of each DP rank, before any forward, and leaves no process and no shared-memory queue behind (no
hang)."""

import os

import pytest

from tests.sglang.live.conftest import FULL_BUDGET, make_server


def test_attention_dp_stops_startup_with_one_line(serving_model, live_logs):
    from flashmemory.serve.cpu_server import ServerError

    queues = lambda: {p for p in os.listdir("/dev/shm") if p.startswith("sgl_shm_mq_")}  # noqa: E731
    before = queues()
    srv = make_server(
        serving_model, live_logs, "attn_dp_refused", env=FULL_BUDGET, extra_args=("--tp", "2", "--attn-dp-size", "2")
    )
    try:
        with pytest.raises(ServerError, match="during startup"):
            srv.wait_ready(600)
        log = srv.log.read_text(errors="replace")
        lines = [l for l in log.splitlines() if l.startswith("FlashMemory startup error: --attn-dp-size 2")]
        assert lines and len(set(lines)) == 1, log[-3000:]
        assert "Prefill batch" not in log and "Decode batch" not in log  # refused before any forward
    finally:
        srv.stop()
    assert srv.leftovers() == []
    assert queues() - before == set()  # the exited schedulers' queues went with the server
