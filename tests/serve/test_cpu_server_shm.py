"""`CpuServer.stop` removes the TP message-queue segments its own stopped processes left, and nothing else."""

from pathlib import Path

from flashmemory.serve.cpu_server import remove_shm_queues


def test_only_the_stopped_processes_queues_go(tmp_path: Path) -> None:
    for name in ("sgl_shm_mq_4242_ab12", "sgl_shm_mq_4242_cd34", "sgl_shm_mq_42421_ef56", "sglang_loads_4242.shm"):
        (tmp_path / name).write_bytes(b"x")
    gone = remove_shm_queues({4242}, shm_dir=tmp_path)
    assert sorted(gone) == ["sgl_shm_mq_4242_ab12", "sgl_shm_mq_4242_cd34"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sgl_shm_mq_42421_ef56", "sglang_loads_4242.shm"]


_EXITS_EARLY = """
import subprocess, sys
WAIT = "import os, sys, time\\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)"
child = subprocess.Popen([sys.executable, "-c", WAIT, sys.argv[1]])
child.wait()  # a scheduler that exits at start-up (a refusal), then its launcher
sys.exit(1)
"""


def test_stop_counts_the_processes_that_exited_while_it_started(tmp_path: Path, monkeypatch) -> None:
    """A scheduler that stops at start-up (a FlashMemory refusal) is gone before `stop` runs: its TP queue is
    removed because `wait_ready` saw its pid (a stand-in server whose child exits once the test has seen it)."""
    import sys
    import threading

    from flashmemory.serve import cpu_server

    removed: list[set[int]] = []
    monkeypatch.setattr(cpu_server, "remove_shm_queues", lambda pids: removed.append(set(pids)) or [])
    go = tmp_path / "go"
    srv = cpu_server.CpuServer(tmp_path / "model", tmp_path / "srv.log")
    srv.cmd = [sys.executable, "-c", _EXITS_EARLY, str(go)]
    srv.launch()
    errors: list[BaseException] = []
    waiter = threading.Thread(target=lambda: _wait(srv, errors), daemon=True)
    waiter.start()
    try:
        while len(srv.seen) < 2 and waiter.is_alive():  # the launcher and its child, seen by wait_ready's polls
            threading.Event().wait(0.05)
        (child,) = srv.seen - {srv.proc.pid}
    finally:
        go.write_text("")  # now the child exits, then the launcher
        waiter.join(60)
    assert errors and "during startup" in str(errors[0])
    assert not srv.leftovers()
    srv.stop()
    assert removed and child in removed[0]


def _wait(srv, errors: list) -> None:
    try:
        srv.wait_ready(60)
    except Exception as e:  # ServerError: the stand-in exits during start-up
        errors.append(e)
