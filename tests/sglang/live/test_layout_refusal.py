"""On the live CPU server, a layout FlashMemory does not serve stops start-up with its one line: data-parallel
replicas (`--dp 2` without attention DP) with Path-P on are refused by the launcher process itself, while sglang
resolves the server arguments (`resolution_step.refuse_at_resolution`), so the launcher exits with the line before it
starts the data-parallel controller or any scheduler, and leaves no process and no shared-memory queue. (sglang
0.5.23's data-parallel controller does not notice its schedulers exiting: a refusal only there would leave the
server running.) Attention DP, served, runs in test_attention_dp_live."""

import os
import time

from tests.sglang.live.conftest import FULL_BUDGET, make_server

LINE = "FlashMemory startup error: --dp 2:"
SCHEDULER_STARTED = ("Init torch distributed", "Load weight", "Prefill batch", "Decode batch")


def test_dp_replicas_stop_the_launcher_with_one_line(serving_model, live_logs):
    queues = lambda: {p for p in os.listdir("/dev/shm") if p.startswith("sgl_shm_mq_")}  # noqa: E731
    before = queues()
    srv = make_server(serving_model, live_logs, "dp_replicas_refused", env=FULL_BUDGET, extra_args=("--dp", "2"))
    try:
        deadline = time.monotonic() + 600  # a guard against a hang, not a timing claim
        while time.monotonic() < deadline and srv.proc.poll() is None:
            srv.seen.update(srv.leftovers())
            log = srv.log.read_text(errors="replace")
            if any(s in log for s in SCHEDULER_STARTED):  # got past the launcher: the refusal came too late
                break
            time.sleep(1.0)
        rc = srv.proc.poll()
        log = srv.log.read_text(errors="replace")
        lines = [line for line in log.splitlines() if line.startswith(LINE)]
        assert rc not in (None, 0), f"launcher still running or exited 0 (rc {rc}):\n{log[-3000:]}"
        assert len(lines) == 1, log[-3000:]  # the launcher's, and no scheduler's
        assert "start one server per replica" in lines[0]  # what to do
        assert not [s for s in SCHEDULER_STARTED if s in log], log[-3000:]  # no scheduler started
    finally:
        srv.stop()
    assert srv.leftovers() == []
    assert queues() - before == set()
