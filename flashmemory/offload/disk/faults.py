"""A fault injector for the disk tier's tests: wraps `FileOps` and fails, tears, corrupts or delays transfers.

Faults are armed as counts ("the next n writes") or as a standing mode (`full`: every write fails with ENOSPC,
as a full disk does, until cleared). Thread-safe: the cache's worker thread and the caller share one injector.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field

from flashmemory.offload.disk.fileops import FileOps, OsFileOps


@dataclass
class FaultPlan:
    """Pending faults. write_errors / read_errors: errnos raised by the next transfers, first first; tear: the
    next writes store only their first `tear_keep` bytes (and report success, as a crash mid-write would leave
    them); corrupt: the next writes land with one byte flipped at `corrupt_at`; full: every write raises ENOSPC;
    delay_s: sleep before every read (a slow drive); read_gate / write_gate: reads / writes block until it is set."""

    write_errors: list[int] = field(default_factory=list)
    read_errors: list[int] = field(default_factory=list)
    tear: int = 0
    tear_keep: int = 4096
    corrupt: int = 0
    corrupt_at: int = 100
    full: bool = False
    delay_s: float = 0.0
    read_gate: threading.Event | None = None  # reads wait until it is set (a read held in flight on purpose)
    write_gate: threading.Event | None = None  # writes wait until it is set (a stalled drive)


class FaultyFileOps:
    """`FileOps` with injected faults; counts what it injected in `injected` (kind -> n)."""

    def __init__(self, inner: FileOps | None = None, plan: FaultPlan | None = None):
        self.inner = inner or OsFileOps()
        self.plan = plan or FaultPlan()
        self.injected: dict[str, int] = {}
        self.damaged: list[bytes] = []  # the first 64 bytes (the slot header) of every torn or corrupted write
        self._lock = threading.Lock()

    def _count(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def pwrite(self, fd: int, buf: memoryview, off: int) -> int:
        gate = self.plan.write_gate
        if gate is not None:
            gate.wait()
        with self._lock:
            p = self.plan
            if p.full:
                self._count("enospc")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if p.write_errors:
                code = p.write_errors.pop(0)
                self._count(errno.errorcode.get(code, str(code)).lower())
                raise OSError(code, os.strerror(code))
            tear = p.tear > 0
            if tear:
                p.tear -= 1
                self._count("tear")
            corrupt = not tear and p.corrupt > 0
            if corrupt:
                p.corrupt -= 1
                self._count("corrupt")
        if tear or corrupt:
            with self._lock:
                self.damaged.append(bytes(buf[:64]))
        if tear:
            keep = min(self.plan.tear_keep, len(buf))
            self.inner.pwrite(fd, buf[:keep], off)
            return len(buf)
        if corrupt:  # flip in place: `buf` is the store's scratch buffer (aligned for O_DIRECT), rebuilt per write
            at = min(self.plan.corrupt_at, len(buf) - 1)
            buf[at] ^= 0xFF
            return self.inner.pwrite(fd, buf, off)
        return self.inner.pwrite(fd, buf, off)

    def preadv(self, fd: int, buf: memoryview, off: int) -> int:
        with self._lock:
            delay, gate = self.plan.delay_s, self.plan.read_gate
            code = self.plan.read_errors.pop(0) if self.plan.read_errors else None
            if code is not None:
                self._count("read_" + errno.errorcode.get(code, str(code)).lower())
        if gate is not None:
            gate.wait()
        if delay > 0:
            time.sleep(delay)
        if code is not None:
            raise OSError(code, os.strerror(code))
        return self.inner.preadv(fd, buf, off)
