"""Start and stop a real `python -m sglang.launch_server --device cpu` process (tests, benches, demos).

The server runs in its own session (process group), so `stop()` reaches the launcher and every child it
spawned (scheduler, detokenizer). Each server carries a unique marker in its environment; `leftovers()` scans
/proc for it, so a caller can prove no process survived. Output goes to a log file; a startup failure raises
`ServerError` with the log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from flashmemory.serve.procs import (
    free_ports,
    loopback_env,
    remove_rendezvous_store,
    remove_server_stores,
    remove_stale_rendezvous_stores,
)
from flashmemory.serve.validate import check_concurrency, check_timeout, max_running_requests, plugin_row_limit

MARKER = "FLASHMEMORY_CPU_SERVER_ID"
# Flags that keep the tiny model's pools small and startup short on CPU (see the module README). sglang's own
# --sleep-on-idle: an idle scheduler otherwise polls at ~35% of a core, so four idle test servers took 1.4 of
# this machine's 2 cores from the ones under test.
CPU_SERVER_ARGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--max-running-requests",
    "4",
    "--context-length",
    "4096",
    "--chunked-prefill-size",
    "1024",
    "--max-prefill-tokens",
    "2048",
    "--max-total-tokens",
    "8192",
    "--swa-full-tokens-ratio",
    "0.5",
    "--skip-server-warmup",
    "--enable-metrics",
    "--sleep-on-idle",
)


class ServerError(RuntimeError):
    """The server did not come up, or a request to it failed."""


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _row_limit(env: dict[str, str]) -> int | None:
    """FlashMemory's row limit in this environment, or None (Path-P off, or an environment the server itself will
    refuse with its own one-line error)."""
    from flashmemory.env import EnvError

    try:
        return plugin_row_limit(env)
    except EnvError:
        return None


class CpuServer:
    """One sglang server on 127.0.0.1 with the CPU layer on; env adds/overrides variables for it."""

    def __init__(
        self,
        model: str | os.PathLike,
        log: str | os.PathLike,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        python: str = sys.executable,
        pythonpath: str | None = None,
    ):
        self.model, self.log = str(model), Path(log)
        self.port = free_ports(1)[0]  # below the ephemeral range: nothing takes it before sglang binds it
        self.id = uuid.uuid4().hex
        self.env = loopback_env(
            {**os.environ, "SGLANG_FLASHMEMORY_CPU": "1", "OMP_NUM_THREADS": "1", MARKER: self.id, **(env or {})},
            self.id,
        )
        if pythonpath:
            rest = os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else ""
            self.env["PYTHONPATH"] = pythonpath + rest
        self.cmd = [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *CPU_SERVER_ARGS,
            *extra_args,
        ]
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.seen: set[int] = set()  # pids of this server's processes seen while it started (some exit early)
        limit = _row_limit(self.env)
        if limit is not None:  # a request over FlashMemory's row limit would get HTTP 500: refuse to start
            check_concurrency(max_running_requests(self.cmd), limit, "SGLANG_PATHP_DECODE_MAX_CONC")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300) -> "CpuServer":
        check_timeout(timeout_s, "start-up timeout_s")
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> "CpuServer":
        """Start the process (returns at once; `wait_ready` waits for /health)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float = 300) -> "CpuServer":
        """Wait until /health answers 200, at most until `timeout_s` after launch (`startup_s`: launch to the first
        200); ServerError with the log tail if not. /health is always asked once, so a server that came up long
        ago (a shared one, waited for again by a later user) answers at once instead of being timed out."""
        t0 = self._t0
        while True:
            if self.proc.poll() is not None:
                when = "during startup" if self.startup_s is None else f"{self.startup_s:.0f} s after it was ready"
                raise ServerError(
                    f"server exited with {self.proc.returncode} {when}; log {self.log}:\n{_tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        if self.startup_s is None:
                            self.startup_s = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 >= timeout_s:
                break
            self.seen.update(self.leftovers())  # a scheduler that exits at start-up leaves its queue: `stop` needs it
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"server not healthy after {timeout_s:.0f} s; log {self.log}:\n{_tail(self.log)}")

    def post(self, path: str, body: dict, timeout_s: float = 600) -> Any:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"POST {path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"POST {path}: {e}; log {self.log}:\n{_tail(self.log)}") from None

    def get_text(self, path: str, timeout_s: float = 30) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return r.read().decode()

    def generate(
        self, input_ids: list[int], max_new_tokens: int, top_logprobs: int = 0, timeout_s: float = 600
    ) -> dict:
        """Greedy generation from token ids: {'output_ids': [...], 'meta_info': {...}}."""
        body: dict = {
            "input_ids": list(map(int, input_ids)),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        if top_logprobs:
            body.update(return_logprob=True, top_logprobs_num=top_logprobs, logprob_start_len=len(input_ids) - 1)
        return self.post("/generate", body, timeout_s)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after timeout_s; then remove the shared-memory
        message queues (`/dev/shm/sgl_shm_mq_<pid>_*`, sglang's TP broadcast queue) that its processes left, those
        of processes that already exited while it started included."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        pids = {pgid, *self.leftovers(), *self.seen}
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            t0 = time.monotonic()
            while time.monotonic() - t0 < wait and self.leftovers():
                time.sleep(0.5)
            if not self.leftovers():
                break
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for pid in self.leftovers():  # children that left the group (setsid) still carry the marker
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        remove_shm_queues(pids)
        remove_server_stores(self.env, pids | set(self.leftovers()))
        remove_rendezvous_store(self.env)
        remove_stale_rendezvous_stores()

    def leftovers(self) -> list[int]:
        """Pids of live processes started by this server (found by the marker in their environment)."""
        return marked_processes(self.id)

    def __enter__(self) -> "CpuServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


SHM_DIR = Path("/dev/shm")


def remove_shm_queues(pids: set[int], shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove `sgl_shm_mq_<pid>_*` segments of the given (stopped) processes: sglang unlinks its TP message queue
    only on a clean exit. Returns the names removed; segments of other processes are never touched."""
    gone = []
    for pid in sorted(pids):
        for seg in shm_dir.glob(f"sgl_shm_mq_{int(pid)}_*"):
            try:
                seg.unlink()
                gone.append(seg.name)
            except OSError:
                continue
    return gone


def marked_processes(server_id: str) -> list[int]:
    needle = f"{MARKER}={server_id}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                stat = (d / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":  # zombies are dead, only not yet reaped
                    found.append(int(d.name))
        except OSError:
            continue
    return found
