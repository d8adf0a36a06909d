"""Atomic file and directory writes: write a temp file beside the target, fsync, then `os.replace`; build a
directory in a temp directory beside it, then rename it into place.

A reader (or a crash) never sees a half-written file: it sees the old file or the new one. A directory published
by `publish_dir` is absent or whole; `file_sha256` is the hash such a directory's manifest records per file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; on normal exit it replaces `path`, on error it is removed."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, hex, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def publish_dir(
    out: Path, write: Callable[[Path], object], intact: Callable[[Path], bool], refuse: Callable[[], Exception]
) -> Path:
    """Build the directory `out` once among concurrent builders, never visible half-written; returns `out`.

    Under an exclusive lock beside it (`.<name>.lock`; the kernel drops it when the holder exits): an `out` that
    already exists is returned as it is when `intact(out)`, else `refuse()` is raised and nothing is deleted.
    Otherwise `write(tmp)` fills a fresh temporary directory beside `out`, its files become 0644 and the directory
    0755 (safetensors and mkdtemp create owner-only ones: the server reading them may run as another user), and
    one rename publishes it. On any error the temporary directory, ours alone, is removed and the error goes on.
    `out`'s parent must exist."""
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            if intact(out):
                return out
            raise refuse()
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        try:
            write(tmp)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.chmod(tmp, 0o755)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out
