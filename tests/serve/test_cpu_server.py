"""`CpuServer.wait_ready` on a stand-in server (a tiny HTTP process answering /health, no sglang)."""

import sys
import time

import pytest

from flashmemory.serve.cpu_server import CpuServer, ServerError

_HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _stand_in(tmp_path, code: str = _HEALTH) -> CpuServer:
    srv = CpuServer(tmp_path / "model", tmp_path / "srv.log")
    srv.cmd = [sys.executable, "-c", code, str(srv.port)]
    return srv.launch()


def test_a_server_ready_long_ago_answers_at_once(tmp_path):
    """The live folder's stock server is launched beside test_live_pd's stacks and waited for again by the shared
    servers 15 minutes later: that second wait once found its whole timeout spent before asking /health, declared
    the healthy server dead and stopped it (10 live tests errored)."""
    srv = _stand_in(tmp_path)
    try:
        srv.wait_ready(60)
        first = srv.startup_s
        srv._t0 -= 3600  # as if launched an hour ago
        assert srv.wait_ready(60) is srv and srv.startup_s == first
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    srv = _stand_in(tmp_path, "import time; time.sleep(600)")
    t = time.monotonic()
    with pytest.raises(ServerError, match="not healthy after 2 s"):
        srv.wait_ready(2)
    assert time.monotonic() - t < 30 and srv.proc.poll() is not None


def test_a_server_that_exits_is_named(tmp_path):
    srv = _stand_in(tmp_path, "import sys; sys.exit(3)")
    with pytest.raises(ServerError, match="exited with 3 during startup"):
        srv.wait_ready(60)
