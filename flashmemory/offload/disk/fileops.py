"""The file operations the disk tier performs, behind one small interface so tests can inject faults.

`OsFileOps` is the real thing: positional reads/writes (`os.preadv` / `os.pwrite`) on a descriptor opened with
O_DIRECT where the filesystem allows it. O_DIRECT needs the buffer, the offset and the length aligned to the
device's logical block; every transfer here goes through a page-aligned anonymous `mmap` buffer of a whole slot
(slot sizes are multiples of `ALIGN`), one per thread, so the same code path serves both modes.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from typing import Protocol

log = logging.getLogger("flashmemory.offload.disk")

ALIGN = 4096  # O_DIRECT alignment used for offsets, lengths and buffers (covers 512-B and 4-KiB devices)


def round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class FileOps(Protocol):
    """What the store needs from the OS. `buf` lengths and `off` are multiples of ALIGN."""

    def pwrite(self, fd: int, buf: memoryview, off: int) -> int: ...

    def preadv(self, fd: int, buf: memoryview, off: int) -> int: ...


class OsFileOps:
    """Plain `os.pwrite` / `os.preadv` (short transfers are completed or raise EIO)."""

    def pwrite(self, fd: int, buf: memoryview, off: int) -> int:
        done = 0
        while done < len(buf):
            n = os.pwrite(fd, buf[done:], off + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite returned {n} at offset {off + done}")
            done += n
        return done

    def preadv(self, fd: int, buf: memoryview, off: int) -> int:
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], off + done)
            if n <= 0:  # past EOF: a slot that was never written completely
                break
            done += n
        return done


class AlignedBuffers:
    """One page-aligned, zero-filled buffer of `size` bytes per thread (anonymous mmap: page-aligned by the OS)."""

    def __init__(self, size: int):
        if size <= 0 or size % ALIGN:
            raise ValueError(f"AlignedBuffers size must be a positive multiple of {ALIGN}, got {size}")
        self.size = size
        self._local = threading.local()
        self._all: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self) -> memoryview:
        mv = getattr(self._local, "mv", None)
        if mv is None:
            mm = mmap.mmap(-1, self.size)
            with self._lock:
                self._all.append(mm)
            mv = self._local.mv = memoryview(mm)
        return mv


def open_direct(path: str, flags: int, mode: int = 0o600, want_direct: bool = True) -> tuple[int, bool, str]:
    """Open `path` with O_DIRECT when asked and allowed; returns (fd, direct, reason when not direct).

    tmpfs and some other filesystems refuse O_DIRECT with EINVAL at open; the fallback is buffered I/O and the
    reason is returned so the caller can log it once.
    """
    if want_direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True, ""
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            reason = f"the filesystem refuses O_DIRECT ({errno.errorcode.get(e.errno, e.errno)}); buffered I/O"
            # O_CREAT|O_EXCL may have created the file before O_DIRECT was refused: open it without O_EXCL then.
            return os.open(path, flags & ~os.O_EXCL if os.path.exists(path) else flags, mode), False, reason
    reason = "O_DIRECT not requested" if not want_direct else "O_DIRECT not available on this platform"
    return os.open(path, flags, mode), False, reason
