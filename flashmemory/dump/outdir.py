"""A dump output directory: checked before any work, locked against a second writer, suspect files moved aside.

One writer per directory: `DirLock` holds an exclusive `flock` on `<dir>/.dump.lock` (the file holds the
holder's pid, for the message a second writer gets). The lock dies with its process, so a crash never leaves
a directory locked. Shards of one input run concurrently into one directory each (a data config lists them
all); two writers in one directory are refused because crash recovery and the sglang staging area both
need the whole directory to themselves.

Nothing the project did not write as a temp file is deleted: `quarantine` moves a suspect file into
`<dir>/.quarantine/` under a free name and returns the message to print. The project's temp files are named
by `tmp_name` (`.tmp-fm<tag>-<target>.<pid>`, where the tag is a hash of the rest of the name); recovery
deletes only names `is_own_tmp` verifies, so a user's `.tmp-notes.txt` is never touched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path

from flashmemory.dump.errors import DumpOutputError

LOCK_FILE = ".dump.lock"
QUARANTINE = ".quarantine"
TMP_PREFIX = ".tmp-"  # every temp name starts so; recovery deletes only those `is_own_tmp` verifies
_TMP_TAG = b"flashmemory-dump-temp/1\0"
_OWN_TMP_RE = re.compile(r"^\.tmp-fm([0-9a-f]{12})-(.+)\.(\d+)$")
LEGACY_TMP_RE = re.compile(r"^\.tmp-(doc_\d{5,}\.safetensors|server_metadata\.jsonl|probe)\.\d+$")  # before the tag


def _tmp_tag(target: str, pid: int) -> str:
    return hashlib.sha256(_TMP_TAG + f"{target}.{pid}".encode("utf-8", "surrogateescape")).hexdigest()[:12]


def tmp_name(target: str, pid: int | None = None) -> str:
    """The name of this project's temp file for `target` (a plain file name), written by process `pid`
    (default: this one): `.tmp-fm<tag>-<target>.<pid>`, tag = 12 hex digits of a sha256 over target and pid,
    so `is_own_tmp` can tell it from any file a user named `.tmp-*`."""
    pid = os.getpid() if pid is None else int(pid)
    return f"{TMP_PREFIX}fm{_tmp_tag(target, pid)}-{target}.{pid}"


def is_own_tmp(name: str) -> bool:
    """True only for a name `tmp_name` makes (its tag matches the rest of the name)."""
    m = _OWN_TMP_RE.match(name)
    return bool(m) and m.group(1) == _tmp_tag(m.group(2), int(m.group(3)))


def os_reason(e: OSError) -> str:
    """'No space left on device' (ENOSPC), or the exception text when it has no strerror."""
    return e.strerror or str(e)


def prepare_output_dir(d: Path) -> None:
    """Create `d` if needed and prove it writable (a probe file is written and removed), or raise
    DumpOutputError naming it. Runs before the model loads and before the first document is generated."""
    if d.exists() and not d.is_dir():
        raise DumpOutputError(f"{d}: --output-dir is a file, not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DumpOutputError(f"{d}: cannot create the output directory ({os_reason(e)})") from None
    probe = d / tmp_name("probe")
    try:
        with open(probe, "wb") as f:
            f.write(b"flashmemory dump write probe\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise DumpOutputError(f"{d}: output directory is not writable ({os_reason(e)})") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


class DirLock:
    """Exclusive lock of a dump directory for the life of this object (or of the process)."""

    def __init__(self, d: Path):
        import fcntl

        self._fd: int | None = None
        self.path = d / LOCK_FILE
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise DumpOutputError(f"{d}: cannot create the lock file {LOCK_FILE} ({os_reason(e)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DumpOutputError(
                    f"{d}: locked by another dump writer (pid {holder}); wait for it to finish "
                    "or give this run its own --output-dir (one directory per shard)"
                ) from None
            raise DumpOutputError(f"{d}: cannot lock {LOCK_FILE} ({os_reason(e)})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def _read_pid(fd: int) -> str:
    try:
        raw = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        raw = ""
    return raw if raw.isdigit() else "unknown"


def quarantine(d: Path, p: Path, reason: str) -> str:
    """Move `p` into `d/.quarantine/` (a free name: `name`, `name.1`, ...). Returns the message for the user."""
    q = d / QUARANTINE
    q.mkdir(exist_ok=True)
    target, n = q / p.name, 0
    while target.exists():
        n += 1
        target = q / f"{p.name}.{n}"
    os.replace(p, target)
    return f"moved {p.name} to {QUARANTINE}/{target.name}: {reason}"
