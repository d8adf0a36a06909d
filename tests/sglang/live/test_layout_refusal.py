"""On the live CPU server, a layout FlashMemory does not serve stops start-up with its one line: data-parallel
replicas (`--dp 2` without attention DP, two schedulers of one rank each) with Path-P on print the refusal from the
scheduler of each replica, before any forward, and leave no process and no shared-memory queue once stopped.
Attention DP, served, runs in test_attention_dp_live.

Known defect, marked xfail: sglang 0.5.23's data-parallel controller does not notice that its schedulers exited
(they are left defunct), so the server process keeps running after the refusal instead of exiting; refusing in
the launcher process (at server-argument resolution) would make it exit."""

import os
import time

import pytest

from tests.sglang.live.conftest import FULL_BUDGET, make_server

LINE = "FlashMemory startup error: --dp 2:"


def test_dp_replicas_stop_startup_with_one_line(serving_model, live_logs):
    queues = lambda: {p for p in os.listdir("/dev/shm") if p.startswith("sgl_shm_mq_")}  # noqa: E731
    before = queues()
    srv = make_server(serving_model, live_logs, "dp_replicas_refused", env=FULL_BUDGET, extra_args=("--dp", "2"))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and srv.proc.poll() is None and len(lines) < 2:
            time.sleep(2.0)
            lines = [l for l in srv.log.read_text(errors="replace").splitlines() if l.startswith(LINE)]
        exit_by = time.monotonic() + 60  # the refusing schedulers are gone: the server should follow
        while time.monotonic() < exit_by and srv.proc.poll() is None:
            time.sleep(2.0)
        exited = srv.proc.poll() is not None
        log = srv.log.read_text(errors="replace")
        lines = [l for l in log.splitlines() if l.startswith(LINE)]
        assert len(lines) == 2 and len(set(lines)) == 1, log[-3000:]  # one line from each replica's scheduler
        assert "Prefill batch" not in log and "Decode batch" not in log  # refused before any forward
    finally:
        srv.stop()
    assert srv.leftovers() == []
    assert queues() - before == set()  # the exited schedulers' queues went with the server
    if not exited:
        pytest.xfail("the --dp 2 server kept running after both schedulers refused (sglang's DP controller)")
