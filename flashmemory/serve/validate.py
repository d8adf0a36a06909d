"""Checks a server stack runs before it starts anything: each failure is one `UserError` line naming the flag or
variable, instead of a server that fails minutes later (or answers HTTP 500 to the request over a limit).

- `check_timeout`: a start-up timeout must be a positive, finite number of seconds.
- `check_port` / `stack_ports`: a fixed port must be free now; the ports of every process of a stack are picked
  together, in one pass that holds each one open until all are chosen, so no two of them collide and a fixed
  port that is taken is named at once.
- `check_concurrency`: sglang's `--max-running-requests` may not exceed FlashMemory's concurrency limit
  (SGLANG_PATHP_DECODE_MAX_CONC, the rows with a decode region): the request over it would fail.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flashmemory.errors import UserError
from flashmemory.serve.procs import free_ports


def check_timeout(seconds: float, what: str) -> float:
    """`seconds` if it is a positive finite number, else UserError naming `what`."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise UserError(f"{what} {seconds}: must be a positive number of seconds")
    return float(seconds)


def _bind(host: str, port: int, what: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise UserError(
            f"{what} {port}: cannot bind {host}:{port} ({e.strerror or e}); another process holds it? "
            "choose another port, or 0 for any free one"
        ) from e
    return s


def check_port(port: int, host: str, what: str) -> None:
    """A fixed port (1-65535) that can be bound on `host` now; 0 means 'pick one' and passes."""
    if not 0 <= port <= 65535:
        raise UserError(f"{what} {port}: must lie in 0-65535 (0: any free port)")
    if port:
        _bind(host, port, what).close()


@dataclass(frozen=True)
class StackPorts:
    """The ports of one PD stack: prefill, decode, the KV bootstrap, the router and the router's Prometheus."""

    prefill: int
    decode: int
    bootstrap: int
    router: int
    prometheus: int


def stack_ports(host: str, router_port: int | None = None, what: str = "--port") -> StackPorts:
    """Every port of a stack in one pass: the fixed router port (if any) is bound and held while the others are
    picked, so none of them can be the same and a taken fixed port is a UserError naming `what`."""
    held = _bind(host, router_port, what) if router_port else None
    try:
        free = free_ports(4 if router_port else 5, host)
    finally:
        if held is not None:
            held.close()
    p, d, b, *rest = free
    r, prom = (router_port, rest[0]) if router_port else (rest[0], rest[1])
    return StackPorts(prefill=p, decode=d, bootstrap=b, router=int(r), prometheus=prom)


def max_running_requests(args: Sequence[str]) -> int | None:
    """The value sglang will use for `--max-running-requests` in `args` (the last one wins), or None."""
    found: int | None = None
    flag = "--max-running-requests"
    for i, a in enumerate(args):
        raw = (
            a[len(flag) + 1 :] if a.startswith(flag + "=") else args[i + 1] if a == flag and i + 1 < len(args) else None
        )
        if raw is not None:
            try:
                found = int(raw)
            except ValueError:
                raise UserError(f"{flag} {raw!r}: expected a whole number") from None
    return found


def check_concurrency(running: int | None, limit: int, limit_name: str) -> None:
    """Refuse `--max-running-requests` above FlashMemory's row limit (`limit_name` = `limit`)."""
    if running is not None and running > limit:
        raise UserError(
            f"--max-running-requests {running} exceeds FlashMemory's concurrency limit {limit_name}="
            f"{limit}: request {limit + 1} would fail; raise {limit_name} or lower "
            "--max-running-requests"
        )


def plugin_row_limit(env: Mapping[str, str]) -> int | None:
    """SGLANG_PATHP_DECODE_MAX_CONC when the server's environment turns Path-P on, else None (no limit)."""
    from flashmemory.env import FlashMemoryEnv

    fm = FlashMemoryEnv.from_environ(env)
    return fm.decode_max_conc if fm.decode_swap_p else None
