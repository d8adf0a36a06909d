"""`ServeCli`: `flashmemory serve --port 0` (the launch scripts under DEVICE=cpu: P, D and the router) driven from
a live test in its own process group: its READY line, its remaining output, the process groups it started, and a
kill of all of them (test_live_pd.py's stacks)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from flashmemory.serve.stack import REPO

READY_TIMEOUT = 900.0


class ServeCli:
    """`flashmemory serve --port 0` in its own process group; `ready` is its READY line."""

    def __init__(self, log_dir: Path, *extra: str):
        """Starts the command; `wait_ready()` waits for its READY line (two stacks can start side by side)."""
        self.log_dir = log_dir
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.t0 = time.monotonic()
        cmd = [
            sys.executable,
            "-m",
            "flashmemory.cli",
            "serve",
            "--port",
            "0",
            "--startup-timeout",
            "900",
            "--logs",
            str(log_dir),
            *extra,
        ]  # 900 s: the default 420 ran out at load 100 (other jobs' servers)
        self.p = subprocess.Popen(
            cmd,
            cwd=str(REPO),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.ready: dict | None = None

    def wait_ready(self) -> "ServeCli":
        self.ready = self._read_until("READY ", READY_TIMEOUT)
        self.ready_s = time.monotonic() - self.t0
        return self

    def _read_until(self, prefix: str, timeout: float) -> dict | None:
        """Lines come through a reader thread (select() on a buffered pipe misses lines already buffered)."""
        if not hasattr(self, "_q"):
            self._q: queue.Queue = queue.Queue()
            threading.Thread(
                target=lambda: [self._q.put(ln) for ln in self.p.stdout] + [self._q.put(None)], daemon=True
            ).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                return None
            self.lines.append(line.rstrip())
            if line.startswith(prefix):
                return json.loads(line[len(prefix) :])
        return None

    def rest(self, timeout: float = 30.0) -> str:
        """What the command printed after READY, up to its exit."""
        out, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            out.append(line)
        return "".join(out)

    def pgids(self) -> set[int]:
        return {self.p.pid} | set((self.ready or {}).get("pgids", []))

    def kill_all(self) -> None:
        for g in self.pgids():
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
