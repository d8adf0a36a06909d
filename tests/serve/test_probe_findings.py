"""`flashmemory serve` misuse ends before any server starts, in one line naming the flag: a fixed port that is
taken, a start-up timeout of zero, more running requests than FlashMemory's row limit; Ctrl-C while the retriever
is built ends in one line with exit 130. The ports of a stack are chosen together."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from flashmemory.errors import UserError
from flashmemory.serve.procs import Servers
from flashmemory.serve.stack import PDConfig, start_pd
from flashmemory.serve.validate import max_running_requests, stack_ports


def _scripts(d):
    """launch_*.sh stand-ins that only record that they ran (nothing must run in these tests)."""
    for name in ("decode", "prefill", "router"):
        (d / f"launch_{name}.sh").write_text(f"echo {name} >> {d / 'started'}\nsleep 30\n")


def _held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_taken_fixed_port_is_named_before_anything_starts(tmp_path) -> None:
    _scripts(tmp_path)
    with _held_port() as held, Servers(tmp_path / "logs") as s:
        port = held.getsockname()[1]
        with pytest.raises(UserError, match=f"--port {port}: cannot bind 127.0.0.1:{port}"):
            start_pd(s, PDConfig(launch_dir=tmp_path, startup_timeout=60), router_port=port)
        assert s.procs == []
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize("t", [0.0, -1.0, float("nan"), float("inf")])
def test_a_startup_timeout_that_is_not_positive_is_refused(tmp_path, t) -> None:
    _scripts(tmp_path)
    with Servers(tmp_path / "logs") as s, pytest.raises(UserError, match="--startup-timeout"):
        start_pd(s, PDConfig(launch_dir=tmp_path, startup_timeout=t))
    assert not (tmp_path / "started").exists()


def test_more_running_requests_than_flashmemorys_rows_is_refused(tmp_path) -> None:
    _scripts(tmp_path)
    cfg = PDConfig(launch_dir=tmp_path, startup_timeout=60, base_env={}, decode_args=("--max-running-requests", "8"))
    with Servers(tmp_path / "logs") as s, pytest.raises(UserError, match=r"--max-running-requests 8 exceeds .*MAX_RUN"):
        start_pd(s, cfg)
    assert not (tmp_path / "started").exists()
    assert max_running_requests(["--max-running-requests", "2", "--max-running-requests=6"]) == 6


def test_a_cpu_server_over_the_row_limit_is_refused(tmp_path) -> None:
    from flashmemory.serve.cpu_server import CpuServer

    env = {"SGLANG_DECODE_SWAP_P": "1", "SGLANG_PATHP_DECODE_MAX_CONC": "2"}
    with pytest.raises(UserError, match="--max-running-requests 4 exceeds .*SGLANG_PATHP_DECODE_MAX_CONC=2"):
        CpuServer(tmp_path, tmp_path / "log", env=env)
    CpuServer(tmp_path, tmp_path / "log", env={**env, "SGLANG_PATHP_DECODE_MAX_CONC": "4"})  # at the limit: fine
    with pytest.raises(UserError, match="timeout"):
        CpuServer(tmp_path, tmp_path / "log").start(timeout_s=0)


def test_stack_ports_are_distinct_and_keep_a_free_fixed_port() -> None:
    ports = stack_ports("127.0.0.1")
    assert len(set(vars(ports).values())) == 5
    with _held_port() as h:
        free = h.getsockname()[1]
    fixed = stack_ports("127.0.0.1", free)
    assert fixed.router == free and len(set(vars(fixed).values())) == 5


_SERVE = textwrap.dedent("""
    import os, signal, sys, time
    import flashmemory.serve.stack as st
    from flashmemory.cli import main
    st.ensure_model = lambda p: p
    def building(model):                      # Ctrl-C while the retriever trains
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    st.ensure_retriever = building
    sys.exit(main(["serve", "--model", sys.argv[1], "--logs", sys.argv[2], "--port", "0"]))
""")


def test_ctrl_c_while_the_retriever_trains_is_one_line_and_130(tmp_path) -> None:
    p = subprocess.run(
        [sys.executable, "-c", _SERVE, str(tmp_path), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 130, p.stderr
    assert p.stderr.strip() == "flashmemory serve: interrupted" and "Traceback" not in p.stderr


def test_serve_refuses_a_zero_timeout_before_building_anything(tmp_path, capsys, monkeypatch) -> None:
    import flashmemory.serve.stack as st
    from flashmemory.cli import main

    def no_build(_p):
        raise AssertionError("the model was built before the flags were checked")

    monkeypatch.setattr(st, "ensure_model", no_build)
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        rc = main(["serve", "--model", str(tmp_path), "--startup-timeout", "0", "--port", "0"])
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("flashmemory serve: error: --startup-timeout 0") and "\n" not in err


def test_a_stopped_servers_stores_are_removed_and_only_those(tmp_path) -> None:
    import json
    import os

    from flashmemory.offload.disk import PageStore
    from flashmemory.offload.disk.store import MARKER
    from flashmemory.serve.cpu_server import remove_server_stores

    def fake(pid: int, token: str) -> str:  # a store its process could not remove (killed): no lock held
        path = tmp_path / f"fm-pagestore-r0-{pid}-{token}.fmps"
        path.write_bytes(
            MARKER + json.dumps({"pid": pid, "host": socket.gethostname(), "token": token}).encode() + b"\n"
        )
        return str(path)

    with PageStore(str(tmp_path), 4 * 8192, 5000) as held:  # a live store of this process: locked
        ours, theirs = fake(4242, "a1" * 8), fake(4343, "b2" * 8)
        env = {"SGLANG_DECODE_SWAP_P": "1", "SGLANG_PATHP_DISK_DIR": str(tmp_path)}
        assert remove_server_stores(env, {4242, os.getpid()}) == [ours]
        assert os.path.exists(theirs) and os.path.exists(held.path)  # another run's; a live one
    assert remove_server_stores({}, {4343}) == []  # no disk tier: nothing to do


# A "server" whose leader starts a scheduler-like child in its process group; the child opens a page store in
# SGLANG_PATHP_DISK_DIR and ignores SIGTERM, so only SIGKILL stops it and it cannot remove its own store.
_STUBBORN_SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.argv[1] == "leader":
        subprocess.Popen([sys.executable, __file__, "scheduler"]).wait()
    else:
        from flashmemory.offload.disk import PageStore
        store = PageStore(os.environ["SGLANG_PATHP_DISK_DIR"], 4 * 8192, 5000)
        with open(os.environ["STORE_AT"] + ".tmp", "w") as f:
            f.write(store.path)
        os.replace(os.environ["STORE_AT"] + ".tmp", os.environ["STORE_AT"])
        while True:   # a SIGTERM wakes pause() up: keep going, as a scheduler stuck in a forward would
            signal.pause()
""")


def test_serve_stop_sweeps_the_stores_its_killed_schedulers_left_and_nothing_else(tmp_path) -> None:
    """`Servers.stop` (what `flashmemory serve` runs on Ctrl-C) removes the page store of a scheduler (a child of
    a server's leader, not the leader) that had to be SIGKILLed; another live store, a dead store of a process
    that was never the stack's, and a file that is no store stay."""
    import json
    import os
    import time

    from flashmemory.offload.disk import PageStore
    from flashmemory.offload.disk.store import MARKER

    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "server.py"
    script.write_text(_STUBBORN_SERVER)
    (disk / "notes.txt").write_text("not a store")
    env = {
        **os.environ,
        "SGLANG_PATHP_DISK_DIR": str(disk),
        "STORE_AT": str(tmp_path / "store_at"),
        "PYTHONPATH": os.pathsep.join(
            [str(__import__("flashmemory.serve.stack").serve.stack.REPO), os.environ.get("PYTHONPATH", "")]
        ),
    }
    with PageStore(str(disk), 4 * 8192, 5000) as live:
        servers = Servers(tmp_path / "logs")
        proc = servers.start("decode", [sys.executable, str(script), "leader"], env)
        deadline = time.monotonic() + 120
        while not (tmp_path / "store_at").exists() and time.monotonic() < deadline:
            assert proc.popen.poll() is None, proc.log_tail()
            time.sleep(0.1)
        left = (tmp_path / "store_at").read_text()
        # a dead run that is not this stack's (written after the scheduler's store opened: opening one sweeps these)
        foreign = disk / f"fm-pagestore-r0-4343-{'b2' * 8}.fmps"
        foreign.write_bytes(
            MARKER + json.dumps({"pid": 4343, "host": socket.gethostname(), "token": "b2" * 8}).encode() + b"\n"
        )
        assert os.path.exists(left) and os.path.dirname(left) == str(disk)
        swept = servers.stop(grace=1.0)
        assert servers.leftovers() == []
        assert swept == [left] and not os.path.exists(left)
        assert os.path.exists(live.path) and foreign.exists() and (disk / "notes.txt").exists()
