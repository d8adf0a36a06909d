"""Servers: process groups started, waited for over HTTP, and stopped with every member gone."""
import sys

import pytest

from flashmemory.serve.procs import ServerStartError, Servers, free_ports, http_get


def test_stop_kills_the_whole_group_including_grandchildren(tmp_path):
    s = Servers(tmp_path)
    # the leader ignores SIGTERM and leaves two background children: only the group kill + SIGKILL stops them
    p = s.start("g", ["bash", "-c", "trap '' TERM; sleep 300 & sleep 300 & wait"])
    import time
    deadline = time.monotonic() + 10
    while len(s.leftovers()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(s.leftovers()) == 3
    s.stop(grace=1.0)
    assert s.leftovers() == [] and p.popen.returncode is not None


def test_wait_http_answers_then_context_exit_stops(tmp_path):
    port = free_ports(1)[0]
    with Servers(tmp_path) as s:
        p = s.start("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=str(tmp_path))
        assert s.wait_http(p, f"http://127.0.0.1:{port}/", timeout=60) >= 0
    assert s.leftovers() == [] and http_get(f"http://127.0.0.1:{port}/", timeout=1)[0] == 0


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    with Servers(tmp_path) as s:
        p = s.start("bad", ["bash", "-c", "echo 'error: MODEL=/x does not exist' >&2; exit 2"])
        with pytest.raises(ServerStartError, match="MODEL=/x does not exist"):
            s.wait_http(p, f"http://127.0.0.1:{free_ports(1)[0]}/health", timeout=30)


def test_free_ports_are_distinct():
    ports = free_ports(5)
    assert len(set(ports)) == 5


def test_router_ready_needs_every_worker_healthy():
    from flashmemory.serve.stack import router_ready
    assert router_ready(200, b'{"status":"ready","healthy_workers":2,"total_workers":2}')
    assert not router_ready(200, b'{"status":"ready","healthy_workers":1,"total_workers":2}')
    assert not router_ready(200, b'{"status":"not ready","healthy_workers":0,"total_workers":0}')
    assert not router_ready(503, b"") and not router_ready(200, b"OK")
