"""The disk tier's edges: liveness by lock (not pid), removal at SIGTERM / SIGINT, capacity against the
filesystem, a full disk at creation, and a disk directory without the gate that uses it -- each a clear line
naming the path and the setting, never a silent result."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from flashmemory.env import EnvError, FlashMemoryEnv
from flashmemory.offload.disk import DiskTierError, FaultPlan, FaultyFileOps, PageStore, remove_stale_stores
from flashmemory.offload.disk.store import MARKER

PB = 5000


def _fake_store(d: str, pid: int, token: str) -> str:
    """A store file as a run with `pid` writes it (name + marker), held by nobody."""
    path = os.path.join(d, f"fm-pagestore-r0-{pid}-{token}.fmps")
    body = MARKER + json.dumps({"pid": pid, "host": socket.gethostname(), "rank": 0, "token": token}).encode()
    with open(path, "wb") as f:
        f.write(body + b"\n")
    return path


def test_a_store_whose_pid_was_reused_is_stale_a_locked_one_is_not(tmp_path) -> None:
    d = str(tmp_path)
    reused = _fake_store(d, os.getpid(), "ab" * 8)  # the pid runs (this process), but nobody holds the lock
    live = PageStore(d, 4 * 8192, PB)  # opening a store sweeps the directory
    assert live.stale_removed == [reused] and not os.path.exists(reused)
    assert remove_stale_stores(d) == [] and os.path.exists(live.path)  # the lock keeps a live store
    live.close()


_HOLD = textwrap.dedent("""
    import sys, time
    from flashmemory.offload.disk import PageStore
    s = PageStore(sys.argv[1], 4 * 8192, 5000)
    s.write("r", 0, bytes(5000))
    print(s.path, flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_server_removes_its_store_and_nothing_else(tmp_path, sig) -> None:
    keep = tmp_path / "notes.txt"
    keep.write_text("user data")
    other = _fake_store(str(tmp_path), 1, "cd" * 8)  # not this process's: only a sweep at open may take it
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, stderr=subprocess.DEVNULL
    )
    try:
        path = p.stdout.readline().strip()
        assert path and os.path.exists(path)
        other_back = _fake_store(str(tmp_path), 1, "ef" * 8)  # written after the child's sweep
        p.send_signal(sig)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0  # the signal still ends the process
    assert not os.path.exists(path)  # ... and its store is gone
    assert keep.read_text() == "user data" and os.path.exists(other_back)
    assert not os.path.exists(other)  # swept when the child opened (nobody held its lock)


def test_a_budget_larger_than_the_filesystem_is_refused_naming_both_sizes(tmp_path, monkeypatch) -> None:
    fs = SimpleNamespace(f_blocks=1000, f_bavail=500, f_frsize=4096)  # a 4.1 MB filesystem, half free
    monkeypatch.setattr(os, "statvfs", lambda _p: fs)
    with pytest.raises(DiskTierError) as e:
        PageStore(str(tmp_path), 10**9, PB)
    msg = str(e.value)
    assert str(tmp_path) in msg and "SGLANG_PATHP_DISK_GB" in msg and "1 GB" in msg and "0.0041 GB" in msg
    assert os.listdir(tmp_path) == []


def test_a_budget_above_the_free_space_is_logged(tmp_path, monkeypatch, caplog) -> None:
    fs = SimpleNamespace(f_blocks=10**6, f_bavail=4, f_frsize=4096)
    monkeypatch.setattr(os, "statvfs", lambda _p: fs)
    with caplog.at_level("WARNING", logger="flashmemory.offload.disk"), PageStore(str(tmp_path), 4 * 8192, PB):
        pass
    assert "SGLANG_PATHP_DISK_GB" in caplog.text and str(tmp_path) in caplog.text and "free" in caplog.text


def test_a_full_disk_at_creation_names_path_and_setting(tmp_path) -> None:
    with pytest.raises(DiskTierError) as e:
        PageStore(str(tmp_path), 4 * 8192, PB, ops=FaultyFileOps(plan=FaultPlan(full=True)))
    msg = str(e.value)
    assert "SGLANG_PATHP_DISK_DIR" in msg and str(tmp_path) in msg and "SGLANG_PATHP_DISK_GB" in msg
    assert "disk full" in msg and "\n" not in msg


def test_a_disk_dir_without_path_p_is_refused(tmp_path) -> None:
    with pytest.raises(EnvError) as e:
        FlashMemoryEnv.from_environ({"SGLANG_PATHP_DISK_DIR": str(tmp_path)})
    assert "SGLANG_PATHP_DISK_DIR" in str(e.value) and "SGLANG_DECODE_SWAP_P" in str(e.value)
    on = FlashMemoryEnv.from_environ({"SGLANG_PATHP_DISK_DIR": str(tmp_path), "SGLANG_DECODE_SWAP_P": "1"})
    assert on.disk.enabled


def test_an_ignored_signal_removes_nothing(tmp_path) -> None:
    """SIGINT ignored (a background job): the process goes on using its store, so the file stays; SIGTERM then
    removes it."""
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        path = p.stdout.readline().strip()
        p.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=2)
        assert os.path.exists(path)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not os.path.exists(path)
