"""Output directories: one writer at a time (an advisory lock), and old results moved aside, never deleted.

`DirLock(path)` holds `path/.flashmemory.lock` with `fcntl.flock` for as long as it is open; a second
writer (another process, or another open in this one) gets a `DirLockedError` naming the holder's pid.
The kernel drops the lock when the holder exits, however it exits, so a crash never leaves a stale lock;
the lock file itself stays (it is empty apart from the holder's pid).

`move_aside(dir, names)` moves files into a fresh `dir/previous-<UTC time>/` folder and returns it.

`claim_kind(dir, kind, flag)` marks a directory as one command's output (`dir/.flashmemory-kind`, one line) and
refuses a directory that holds another command's, so two commands never write into each other's files.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from flashmemory.errors import UserError

LOCK_NAME = ".flashmemory.lock"
KIND_NAME = ".flashmemory-kind"


class DirLockedError(UserError):
    """Another process is writing to this output directory."""


def prepare_dir(path: str | os.PathLike, flag: str) -> Path:
    """Create `path` (and parents) as a directory; a clear `UserError` if it is a file. OSError otherwise."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {p}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a parent is a file
        raise UserError(f"{flag} {p}: a parent of it is a file, not a directory") from None
    except NotADirectoryError:
        raise UserError(f"{flag} {p}: a parent of it is a file, not a directory") from None
    return p


class DirLock:
    """An exclusive, non-blocking advisory lock on a directory. Use as a context manager or call `release()`."""

    def __init__(self, path: str | os.PathLike, what: str = "output directory"):
        self.fd: int | None = None
        self.dir = Path(path)
        self.path = self.dir / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # PermissionError here = not writable
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise DirLockedError(
                f"{self.dir}: this {what} is being written by another process (pid {holder}, "
                f"lock {self.path}); wait for it to finish or choose another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def move_aside(directory: str | os.PathLike, names: list[str]) -> Path:
    """Move `directory/name` for each name into a new `directory/previous-<UTC time>[-n]/`; returns that folder."""
    d = Path(directory)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest, n = d / f"previous-{stamp}", 1
    while dest.exists():
        n += 1
        dest = d / f"previous-{stamp}-{n}"
    dest.mkdir()
    for name in names:
        os.replace(d / name, dest / name)
    return dest


def dir_kind(directory: str | os.PathLike, flag: str, found: str | None = None) -> str | None:
    """The command whose output `directory` holds: its `.flashmemory-kind` marker's line, else `found` (what the
    caller recognised from its files; None for nothing). UserError naming `flag` for an unreadable marker."""
    marker = Path(directory) / KIND_NAME
    if not marker.is_file():
        return found
    try:
        kind = (marker.read_text(encoding="utf-8").strip().splitlines() or [""])[0][:80]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {directory}: cannot read its kind marker {marker} ({e})") from None
    if not kind:
        raise UserError(f"{flag} {directory}: its kind marker {marker} is empty; use another {flag}")
    return kind


def claim_kind(directory: str | os.PathLike, kind: str, flag: str, found: str | None = None) -> None:
    """Refuse `directory` unless it holds `kind`'s output, then mark it so (call it under the `DirLock`).

    The kind is `dir_kind`'s: the marker `directory/.flashmemory-kind`, else `found`; an unmarked directory is
    marked `kind` when that agrees. UserError naming `flag`, the directory and the kind found otherwise; the
    marker is written atomically."""
    d = Path(directory)
    marker = d / KIND_NAME
    found = dir_kind(d, flag, found)
    if found is not None and found != kind:
        raise UserError(
            f"{flag} {d}: holds the output of `flashmemory {found}`, not `flashmemory {kind}`; use another {flag}"
        )
    if not marker.is_file():
        tmp = d / f"{KIND_NAME}.{os.getpid()}.tmp"
        tmp.write_text(kind + "\n", encoding="utf-8")
        os.replace(tmp, marker)
