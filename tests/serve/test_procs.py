"""Servers: process groups started, waited for over HTTP, and stopped with every member gone."""

import subprocess
import sys
from pathlib import Path

import pytest

from flashmemory.serve.procs import Servers, ServerStartError, free_ports, http_get


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


def test_free_ports_avoid_the_ephemeral_range_and_sglangs_own_pick():
    """Ports bound only tens of seconds later must not be ones bind(0) hands to anyone else (32768+), nor the
    range sglang picks its NCCL port from (22000-29999): two stacks side by side once stole each other's."""
    from flashmemory.serve.procs import PORT_RANGE

    lo, hi = PORT_RANGE
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        eph_low = int(f.read().split()[0])
    assert hi < min(eph_low, 22000)
    assert all(lo <= p <= hi for p in free_ports(8))


def test_free_ports_skip_a_port_someone_holds():
    import random
    import socket

    from flashmemory.serve.procs import PORT_RANGE

    first = random.Random(7).sample(range(PORT_RANGE[0], PORT_RANGE[1] + 1), 1)[0]
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", first))
        except OSError:
            pytest.skip(f"port {first} is in use on this box already")
        held.listen()
        assert first not in free_ports(1, rng=random.Random(7))


def _fake_launch_scripts(d, clash_times: int):
    """Stand-ins for launch_{decode,prefill,router}.sh: D fails `clash_times` times with EADDRINUSE (as a server
    whose port another stack took meanwhile does), then every script serves /health and /readiness on $PORT."""
    server = d / "serve.py"
    server.write_text(
        "import http.server, json, os\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        b = json.dumps({'status': 'ready', 'healthy_workers': 2, 'total_workers': 2}).encode()\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b)\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), H).serve_forever()\n"
    )
    count = d / "decode_starts"
    (d / "launch_decode.sh").write_text(
        f"echo x >> {count}\n"
        f"if [ $(wc -l < {count}) -le {clash_times} ]; then\n"
        "  echo 'OSError: [Errno 98] Address already in use' >&2; exit 1\nfi\n"
        f"exec {sys.executable} {server}\n"
    )
    for name in ("prefill", "router"):
        (d / f"launch_{name}.sh").write_text(f"exec {sys.executable} {server}\n")
    return count


def test_start_pd_retries_a_port_clash_with_fresh_ports(tmp_path, capsys):
    from flashmemory.serve.stack import PDConfig, start_pd

    count = _fake_launch_scripts(tmp_path, clash_times=1)
    with Servers(tmp_path / "logs") as s:
        stack = start_pd(s, PDConfig(launch_dir=tmp_path, startup_timeout=60))
        assert http_get(stack.router_url + "/readiness")[0] == 200
    assert count.read_text().count("x") == 2
    assert (
        "port clash (decode: address already in use); retrying with fresh ports (attempt 2/3)"
        in capsys.readouterr().out
    )
    assert s.leftovers() == []


def test_start_pd_gives_up_after_its_attempts_and_other_failures_are_not_retried(tmp_path):
    from flashmemory.serve.stack import PDConfig, start_pd

    count = _fake_launch_scripts(tmp_path, clash_times=5)
    with Servers(tmp_path / "logs") as s:
        with pytest.raises(ServerStartError, match="Address already in use"):
            start_pd(s, PDConfig(launch_dir=tmp_path, startup_timeout=60), attempts=2)
    assert count.read_text().count("x") == 2
    (tmp_path / "launch_decode.sh").write_text("echo 'error: MODEL=/x does not exist' >&2; exit 2\n")
    with Servers(tmp_path / "logs2") as s:
        with pytest.raises(ServerStartError, match="MODEL=/x"):
            start_pd(s, PDConfig(launch_dir=tmp_path, startup_timeout=60))
    assert count.read_text().count("x") == 2


def test_a_process_whose_main_thread_exited_counts_until_its_last_thread_has(tmp_path):
    """A killed scheduler's main thread can be a zombie while its other threads still run (and hold its files
    and their locks open): it is still a member of its group until the last thread has exited."""
    import time

    from flashmemory.serve.procs import _pgid_members

    code = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(300,)).start()\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )  # the main thread exits; the sleeper goes on
    s = Servers(tmp_path)
    p = s.start("half", [sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(f"/proc/{p.popen.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the main thread never exited")
        assert _pgid_members({p.popen.pid}) == [p.popen.pid]
    finally:
        s.stop(grace=1.0)
    assert s.leftovers() == []


LOOPBACK_SPELLINGS = {
    # the IPv6 loopback in every spelling, the full one included, and 127.0.0.0/8
    **dict.fromkeys(["::1", "[::1]", "0:0:0:0:0:0:0:1", "0000:0000:0000:0000:0000:0000:0000:0001"], True),
    **dict.fromkeys(["0::1", "::0:1", "0:0::0:1", "::0001", "0:0:0:0:0:0::1", "::0:0:0:0:0:0:1"], True),
    **dict.fromkeys(["127.0.0.1", "127.1.2.3", "127.255.255.255", "localhost", "LOCALHOST"], True),
    # not loopback, or not an address (refused: the stock, open defaults apply)
    **dict.fromkeys(["::", "::2", "1::1", "::1:0", "fe80::1", ":::1", ":1", "0:0:0:0:0:0:0:0:1"], False),
    **dict.fromkeys(["0:0:0:0:0:0:1", "0:0:0:0:0:0:0::1", "::00001", "[::1", "::1]", "0::0::1"], False),
    **dict.fromkeys(["::ffff:127.0.0.1", "127.256.0.1", "127.0.0.01", "127.1", "127.foo", "localhost."], False),
    **dict.fromkeys(["0.0.0.0", "10.0.0.1", "example.com", ""], False),
}


def test_loopback_hosts_are_recognised_in_every_spelling_by_python_and_the_scripts():
    """Where local-only is decided (`is_loopback_host` for `flashmemory serve`, `fm_is_loopback` for the launch
    scripts): the IPv6 loopback spelled in full (0:0:0:0:0:0:0:1) got none of the local-only defaults before;
    both agree with the expected answer on every spelling."""
    from flashmemory.serve.procs import is_loopback_host

    script = Path(__file__).resolve().parents[2] / "scripts" / "launch_common.sh"
    probe = 'source "$1" >/dev/null 2>&1; for h in "${@:2}"; do fm_is_loopback "$h" && echo 1 || echo 0; done'
    hosts = list(LOOPBACK_SPELLINGS)
    p = subprocess.run(["bash", "-c", probe, "bash", str(script), *hosts], capture_output=True, text=True, timeout=60)
    got_sh = dict(zip(hosts, (line == "1" for line in p.stdout.splitlines()), strict=True))
    assert {h: is_loopback_host(h) for h in hosts} == LOOPBACK_SPELLINGS
    assert got_sh == LOOPBACK_SPELLINGS
