"""Server processes on this machine: each in its own process group, waited for over HTTP, stopped as a group.

sglang's launcher spawns a scheduler and a detokenizer (and the router a Rust server); they stay in the
launcher's process group, so signalling the group reaches all of them. `Servers` is a context manager: on exit
(success, failure or Ctrl-C) it sends SIGTERM to every group it started, waits, then SIGKILLs what is left, and
`leftovers()` says whether any process of those groups still exists (it should not). Once they are gone, the
disk-tier page stores their processes left (a process killed outright cannot remove its own) are removed: only
stores named with the pid of a process of those groups, and only unlocked ones (`remove_server_stores`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RENDEZVOUS_VAR = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"
STORE_PREFIX = "flashmemory-dist-"


def is_loopback_host(host: str) -> bool:
    """localhost, an address of 127.0.0.0/8, or the IPv6 loopback in any spelling (::1, 0:0:0:0:0:0:0:1,
    0::0001, [::1]): a server bound there is reachable from this machine only. The twin of `fm_is_loopback` in
    scripts/launch_common.sh (tests/serve/test_procs.py checks both on many spellings)."""
    h = host.strip().lower()
    if h == "localhost":
        return True
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:  # a host name other than localhost, or not an address
        return False


def rendezvous_store(tag: str) -> str:
    """A torch.distributed file-store init method, fresh per server (`tag` unique): file://<tempdir>/..."""
    return f"file://{Path(tempfile.gettempdir()) / (STORE_PREFIX + tag)}"


def loopback_env(env: Mapping[str, str], tag: str) -> dict[str, str]:
    """`env` plus the defaults that keep every listener of an sglang server bound on 127.0.0.1, not only its HTTP
    port (the Python twin of `fm_local_only` in scripts/launch_common.sh): sglang's KV-transfer sockets
    (SGLANG_HOST_IP), gloo's and NCCL's socket interface, Mooncake's TCP transport, NIXL's UCX network devices, and
    the torch.distributed rendezvous, whose TCPStore listens on every interface whatever address it gets, so a file
    store (one node, created by torch) replaces it. Values already in `env` win. Mooncake's transfer engine,
    which binds every interface whatever it is told, is kept on loopback by the launch scripts' preloaded shim
    (`flashmemory.serve.loopback`) in a PD stack; a server started from this environment alone moves no KV."""
    defaults = {
        "SGLANG_HOST_IP": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "UCX_NET_DEVICES": "lo",
        RENDEZVOUS_VAR: rendezvous_store(tag),
    }
    return {**defaults, **env}


def remove_rendezvous_store(env: Mapping[str, str]) -> bool:
    """Remove the file store of a stopped server when it is one `rendezvous_store` named (a killed server cannot
    remove it); a store anywhere else is left alone. True when a file was removed."""
    method = env.get(RENDEZVOUS_VAR, "")
    path = Path(method.removeprefix("file://"))
    if (
        not method.startswith("file://")
        or path.parent != Path(tempfile.gettempdir())
        or not path.name.startswith(STORE_PREFIX)
    ):
        return False
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def remove_stale_rendezvous_stores(tmp: Path | None = None) -> list[str]:
    """Remove the `rendezvous_store` files in the temp dir that no live process names in its environment (their
    server was killed with the process that would have removed them, e.g. a SIGKILLed `flashmemory serve`).
    Returns the names removed; files of processes this user cannot read, or cannot remove, are left alone."""
    tmp = Path(tempfile.gettempdir()) if tmp is None else tmp
    stores = {p for p in tmp.glob(STORE_PREFIX + "*") if p.is_file()}
    if not stores:
        return []
    named: set[bytes] = set()
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            named.update(
                v.split(b"=", 1)[1]
                for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if v.startswith(RENDEZVOUS_VAR.encode() + b"=")
            )
        except (OSError, IndexError):
            if Path(f"/proc/{pid}").exists() and not os.access(f"/proc/{pid}/environ", os.R_OK):
                return []  # a process whose environment cannot be read might use any store: keep them all
    removed = []
    for p in sorted(stores):
        if f"file://{p}".encode() not in named:
            try:
                p.unlink()
                removed.append(p.name)
            except OSError:
                pass
    return removed


def remove_server_stores(env: Mapping[str, str], pids: Collection[int]) -> list[str]:
    """The disk-tier page stores that the stopped processes `pids` of one server left in its SGLANG_PATHP_DISK_DIR
    (from `env`, the environment the server was started with); nobody else's, and none whose lock is still held
    (a live store holds it for its whole life). Returns the removed paths."""
    from flashmemory.env import DiskTierConfig, EnvError
    from flashmemory.offload.disk.store import remove_stale_stores

    try:
        d = DiskTierConfig.from_environ(env).dir
    except EnvError:
        return []
    return remove_stale_stores(d, pids) if d and os.path.isdir(d) else []


class ServerStartError(RuntimeError):
    """A server exited or did not answer in time; the message has the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; other users of this box get different ones)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Ports for servers that bind them only later (tens of seconds after the pick): below the kernel's ephemeral
# range (32768+ here), where bind(0)/connect() never hand them to another process, and below sglang's own
# below-ephemeral pick for its NCCL/TCPStore port (22000-29999, srt/utils/network.py), so neither steals ours.
PORT_RANGE = (12000, 21999)


def free_ports(
    n: int, host: str = "127.0.0.1", port_range: tuple[int, int] = PORT_RANGE, rng: random.Random | None = None
) -> list[int]:
    """`n` distinct ports in `port_range` that were free a moment ago (held open together while picking).

    Random within the range, so two stacks picking at once rarely meet; `start_pd` retries a start that still
    hit "address already in use". Raises OSError if the range has no `n` free ports."""
    rng = rng or random.Random()
    lo, hi = port_range
    socks: list[socket.socket] = []
    try:
        for port in rng.sample(range(lo, hi + 1), min(hi - lo + 1, 64 * n)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [int(x.getsockname()[1]) for x in socks]
        raise OSError(f"free_ports: fewer than {n} free ports in {lo}-{hi} on {host}")
    finally:
        for s in socks:
            s.close()


ADDR_IN_USE = ("address already in use", "addrinuse", "eaddrinuse", "errno 98")


def port_clash(text: str) -> bool:
    """Whether a server's log says it could not bind a port another process holds."""
    low = text.lower()
    return any(m in low for m in ADDR_IN_USE)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


def http_post_json(url: str, payload: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _threads_running(pid: str) -> bool:
    """Whether any thread of process `pid` has not exited yet. A killed process's main thread can be a zombie
    while its other threads still exit: until the last one has, its descriptors (and their locks) stay open."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X"):
            return True
    return False


def _pgid_members(pgids: set[int]) -> list[int]:
    """Pids of live processes whose process group is one of `pgids` (read from /proc): zombies excluded once
    every thread of theirs has exited (`_threads_running`)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(rest) > 2 and int(rest[2]) in pgids and (rest[0] != "Z" or _threads_running(d)):
            out.append(int(d))
    return out


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    started: float
    log_offset: int = 0  # the log's size when this process started (logs are appended across restarts)
    env: Mapping[str, str] = field(default_factory=dict)  # the environment it was started with

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        """What this process (not an earlier one with the same name) wrote to its log."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""


@dataclass
class Servers:
    """Processes started by this object; every one in a new session (its own process group)."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None
    ) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as f:
            offset = f.tell()
            p = subprocess.Popen(
                list(argv),
                env=dict(env) if env is not None else None,
                cwd=cwd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(name, p, log, time.monotonic(), offset, dict(env or {}))
        self.procs.append(proc)
        return proc

    def wait_http(self, proc: Proc, url: str, timeout: float, ok=lambda status, body: status == 200) -> float:
        """Poll `url` until `ok(status, body)`; seconds since `proc` started. Raises if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise ServerStartError(
                    f"{proc.name} exited with {proc.popen.returncode} before {url} answered; "
                    f"log {proc.log}:\n{proc.log_tail()}"
                )
            status, body = http_get(url, timeout=5.0)
            if ok(status, body):
                return time.monotonic() - proc.started
            time.sleep(1.0)
        raise ServerStartError(
            f"{proc.name}: {url} did not answer within {timeout:.0f} s; log {proc.log}:\n{proc.log_tail()}"
        )

    def pgids(self) -> set[int]:
        return {p.popen.pid for p in self.procs}  # start_new_session: pgid == pid of the leader

    def stop(self, grace: float = 20.0, only: Sequence[Proc] | None = None) -> list[str]:
        """SIGTERM every group (or those of `only`), wait up to `grace` s for all members to go, then SIGKILL
        the rest; reap leaders. Then remove what the stopped processes left: their rendezvous stores and the
        page stores named with their pids (`remove_server_stores`). Returns the page stores removed."""
        procs = self.procs if only is None else list(only)
        pgids = {p.popen.pid for p in procs}
        members = pgids | set(_pgid_members(pgids))  # the schedulers' pids name their page stores
        for g in pgids:
            try:
                os.killpg(g, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for p in procs:
                p.popen.poll()
            alive = _pgid_members(pgids)
            if not alive:
                break
            members.update(alive)
            time.sleep(0.2)
        for g in pgids:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        t_end = time.monotonic() + 10
        while _pgid_members(pgids) and time.monotonic() < t_end:
            time.sleep(0.2)
        for p in procs:
            remove_rendezvous_store(p.env)
        remove_stale_rendezvous_stores()
        return sorted({path for p in procs for path in remove_server_stores(p.env, members)})

    def leftovers(self) -> list[int]:
        """Pids still alive in the groups this object started ([] after a clean stop)."""
        return _pgid_members(self.pgids())

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
