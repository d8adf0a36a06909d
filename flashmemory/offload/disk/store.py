"""`PageStore`: one rank's page-aligned file of fixed-size page slots on local disk (the disk tier).

File: `<dir>/fm-pagestore-r<rank>-<pid>-<token>.fmps`, created O_EXCL and held under an exclusive `flock` for the
store's life. Block 0 is a marker (`MARKER` + one JSON line: pid, host, rank, token); slot s starts at
`ALIGN * (1 + s * slot_blocks)`. A slot holds one page: a header (magic, the run token, a digest of the rid,
page, write sequence, payload length), the payload, and a blake2b-128 digest of header + payload; a read is
verified against all of them, so a torn or corrupt write, a slot of another run or another page is a
`CorruptPageError(rid, page)`, never wrong bytes.

Writes go to a fresh slot and the page's map entry moves only once the write returned (copy on write): a failed
rewrite leaves the previous copy readable. Freed slots return to a free list at once (the file is not shrunk).
Liveness is the lock alone, never the pid (pids are reused, e.g. in containers): a store whose file nobody holds
the lock on belongs to a dead run. Stale stores (our name, our marker, this host, no one holding the lock) are
removed when a store opens in the same directory; any other file there is never touched. `close()` removes the
store's own file; SIGTERM / SIGINT / exit remove it too (`owned`).

Capacity is checked against the filesystem at start-up: a size above the filesystem's is refused, one above its
free space is logged (the file grows as pages are written); running out of space while creating the file is a
`DiskTierError` naming the path and the setting.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import struct
import threading
from collections.abc import Collection

from flashmemory.errors import UserError, describe
from flashmemory.offload.disk import owned
from flashmemory.offload.disk.fileops import ALIGN, AlignedBuffers, FileOps, OsFileOps, open_direct, round_up

log = logging.getLogger("flashmemory.offload.disk")

MARKER = b"FLASHMEMORY-PAGESTORE v1\n"
NAME_RE = re.compile(r"^fm-pagestore-r(\d+)-(\d+)-([0-9a-f]{16})\.fmps$")
_HDR = struct.Struct("<8s8s16sqQI")  # magic, run token, rid digest, page, sequence, payload length
_MAGIC = b"FMPAGE01"
_DIGEST = 16
HEADER_BYTES = _HDR.size + _DIGEST


class DiskTierError(UserError):
    """The disk tier cannot start: its directory is missing, not writable, or its size holds no page."""


class CorruptPageError(RuntimeError):
    """A page read back from disk failed verification (torn or corrupt write, or a slot not holding it).
    An error of request `rid` only: that request is finished with this message, the server keeps serving."""

    def __init__(self, rid: str, page: int, why: str):
        super().__init__(
            f"disk tier: page {page} of request {rid!r} is corrupt on disk ({why}); the request cannot continue"
        )
        self.rid, self.page, self.why = rid, page, why


def rid_digest(rid: str) -> bytes:
    return hashlib.blake2b(rid.encode(), digest_size=16).digest()


def read_marker(path: str) -> dict | None:
    """The JSON of a store file's marker block, or None when the file does not start with our marker."""
    try:
        with open(path, "rb") as f:
            head = f.read(ALIGN)
    except OSError:
        return None
    if not head.startswith(MARKER):
        return None
    try:
        info = json.loads(head[len(MARKER) :].split(b"\n", 1)[0])
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def remove_stale_stores(directory: str, pids: Collection[int] | None = None) -> list[str]:
    """Remove page stores of dead runs in `directory` (only those created by `pids` when given: a server's
    processes, swept once they are stopped); returns the removed paths.

    Removed only when ALL hold: the name is ours (NAME_RE), the marker block is ours with the pid and token of
    the name, the host is this host, and nobody holds the file's lock (a live store holds it for its whole life;
    the OS drops it when its process dies, however it dies). Anything else stays.
    """
    removed = []
    host = socket.gethostname()
    for name in sorted(os.listdir(directory)):
        m = NAME_RE.match(name)
        if not m or (pids is not None and int(m.group(2)) not in pids):
            continue
        path = os.path.join(directory, name)
        info = read_marker(path)
        if (
            not info
            or info.get("host") != host
            or info.get("pid") != int(m.group(2))
            or info.get("token") != m.group(3)
        ):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            os.unlink(path)
            removed.append(path)
            log.info("disk tier: removed %s, the page store of a dead run (pid %s)", path, m.group(2))
        except OSError as e:
            log.warning("disk tier: could not remove stale store %s: %s", path, e)
        finally:
            os.close(fd)
    return removed


def fs_space(directory: str) -> tuple[int, int]:
    """(size, free) in bytes of the filesystem holding `directory` (free: what this user may still write)."""
    st = os.statvfs(directory)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def check_capacity(directory: str, need: int, what: str, size_what: str) -> None:
    """Refuse a store of `need` bytes larger than the filesystem holding `directory` (one line naming the path,
    the setting and both sizes); log one line when it is larger than the space free now (the file grows as
    pages are written, so a later write may find the disk full: those pages stay in host memory)."""
    size, free = fs_space(directory)
    if need > size:
        raise DiskTierError(
            f"{what}={directory!r}: {size_what} asks for a {need / 1e9:.3g} GB page store, larger "
            f"than the filesystem there ({size / 1e9:.3g} GB); lower {size_what}"
        )
    if need > free:
        log.warning(
            "disk tier: %s=%r: %s asks for %.3g GB, only %.3g GB free there now; pages that find the disk "
            "full stay in host memory",
            what,
            directory,
            size_what,
            need / 1e9,
            free / 1e9,
        )


def _create_error(e: OSError, path: str, what: str, size_what: str) -> DiskTierError:
    """The one line for an OS error while creating the store file (disk full, no inodes, permission, ...)."""
    hint = f"; free space there or lower {size_what}" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return DiskTierError(f"{what}: cannot create the page store {path}: {describe(e).split(': ', 1)[-1]}{hint}")


class PageStore:
    """Fixed-size page slots in one file. Keys are (rid, page); payloads are exactly `page_bytes` bytes.

    Thread-safe: the slot map is under a lock, transfers run outside it (one aligned buffer per thread).
    Invariant: every mapped slot holds a verified copy of its key's last completed write; `free_slots +
    used_slots == n_slots` where `used_slots` counts mapped slots and slots of writes in flight.
    """

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        page_bytes: int,
        rank: int = 0,
        ops: FileOps | None = None,
        direct: bool = True,
        what: str = "SGLANG_PATHP_DISK_DIR",
        size_what: str = "SGLANG_PATHP_DISK_GB",
    ):
        if page_bytes < 1:
            raise ValueError(f"PageStore.page_bytes must be >= 1, got {page_bytes}")
        if not os.path.isdir(directory):
            raise DiskTierError(f"{what}={directory!r}: not an existing directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise DiskTierError(f"{what}={directory!r}: not writable by this process")
        self.page_bytes = page_bytes
        self.slot_bytes = round_up(HEADER_BYTES + page_bytes)
        self.n_slots = capacity_bytes // self.slot_bytes
        if self.n_slots < 1:
            raise DiskTierError(
                f"disk tier: {capacity_bytes} B holds no {self.slot_bytes}-B page slot (raise {size_what})"
            )
        self.ops: FileOps = ops or OsFileOps()
        self.stale_removed = remove_stale_stores(directory)
        check_capacity(directory, ALIGN + self.n_slots * self.slot_bytes, what, size_what)
        self.token = secrets.token_hex(8)
        self.path = os.path.join(directory, f"fm-pagestore-r{rank}-{os.getpid()}-{self.token}.fmps")
        try:
            self.fd, self.direct, reason = open_direct(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, direct)
        except OSError as e:
            raise _create_error(e, self.path, what, size_what) from e
        owned.own(self.path)
        if reason and direct:
            log.warning("disk tier: %s: %s", self.path, reason)
        self.fallback_reason = reason
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._buf = AlignedBuffers(self.slot_bytes)
            info = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "rank": rank,
                "token": self.token,
                "page_bytes": page_bytes,
                "slot_bytes": self.slot_bytes,
            }
            head = MARKER + json.dumps(info, sort_keys=True).encode() + b"\n"
            block = AlignedBuffers(ALIGN).get()
            block[: len(head)] = head
            self.ops.pwrite(self.fd, block, 0)
        except BaseException as e:  # a store that could not start leaves no file behind
            os.close(self.fd)
            os.unlink(self.path)
            owned.disown(self.path)
            if isinstance(e, OSError):
                raise _create_error(e, self.path, what, size_what) from e
            raise
        self._tok = bytes.fromhex(self.token)
        self._lock = threading.Lock()
        self._free = list(range(self.n_slots - 1, -1, -1))  # pop() hands out low slots first
        self._map: dict[tuple[str, int], tuple[int, int]] = {}  # key -> (slot, sequence)
        self._by_rid: dict[str, set[int]] = {}
        self._seq = 0
        self.closed = False
        log.info(
            "disk tier: page store %s, %d slots of %d B (%.2f GB), %s",
            self.path,
            self.n_slots,
            self.slot_bytes,
            self.n_slots * self.slot_bytes / 1e9,
            "O_DIRECT" if self.direct else "buffered",
        )

    # -- bookkeeping ---------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.n_slots - len(self._free)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._map

    def pages_of(self, rid: str) -> set[int]:
        with self._lock:
            return set(self._by_rid.get(rid, ()))

    def _offset(self, slot: int) -> int:
        return ALIGN + slot * self.slot_bytes

    # -- transfers -----------------------------------------------------------------------------------
    def write(self, rid: str, page: int, data: bytes | bytearray | memoryview) -> None:
        """Store page `page` of `rid` (exactly page_bytes). Raises OSError(ENOSPC) when no slot is free or the
        disk is full, or the OS error (EIO, ...) of the write; on any error the previous copy stays readable."""
        mv = memoryview(data).cast("B")
        if mv.nbytes != self.page_bytes:
            raise ValueError(f"PageStore.write: {mv.nbytes} B for a {self.page_bytes}-B page")
        with self._lock:
            if not self._free:
                raise OSError(
                    errno.ENOSPC, f"disk tier: all {self.n_slots} page slots in use (raise SGLANG_PATHP_DISK_GB)"
                )
            slot = self._free.pop()
            self._seq += 1
            seq = self._seq
        buf = self._buf.get()
        hdr = _HDR.pack(_MAGIC, self._tok, rid_digest(rid), page, seq, self.page_bytes)
        buf[: _HDR.size] = hdr
        end = _HDR.size + self.page_bytes
        buf[_HDR.size : end] = mv
        buf[end : end + _DIGEST] = hashlib.blake2b(buf[:end], digest_size=_DIGEST).digest()
        try:
            self.ops.pwrite(self.fd, buf, self._offset(slot))
        except BaseException:
            with self._lock:
                self._free.append(slot)
            raise
        with self._lock:
            old = self._map.get((rid, page))
            self._map[(rid, page)] = (slot, seq)
            self._by_rid.setdefault(rid, set()).add(page)
            if old is not None:
                self._free.append(old[0])

    def read(self, rid: str, page: int, out: memoryview | None = None) -> bytearray | memoryview:
        """Page `page` of `rid`, verified; into `out` (page_bytes, writable) when given. KeyError when the store
        does not hold it; CorruptPageError when the bytes fail verification."""
        with self._lock:
            slot, seq = self._map[(rid, page)]
        buf = self._buf.get()
        try:
            n = self.ops.preadv(self.fd, buf, self._offset(slot))
        except OSError as e:
            raise CorruptPageError(rid, page, f"read failed: {e.strerror or e}") from e
        end = _HDR.size + self.page_bytes
        if n < end + _DIGEST:
            raise CorruptPageError(rid, page, f"short slot ({n} of {end + _DIGEST} B)")
        magic, tok, rd, pg, sq, ln = _HDR.unpack(bytes(buf[: _HDR.size]))
        if magic != _MAGIC or tok != self._tok:
            raise CorruptPageError(rid, page, "slot header is not this run's")
        if hashlib.blake2b(buf[:end], digest_size=_DIGEST).digest() != bytes(buf[end : end + _DIGEST]):
            raise CorruptPageError(rid, page, "checksum mismatch (torn or corrupt write)")
        if rd != rid_digest(rid) or pg != page or sq != seq or ln != self.page_bytes:
            raise CorruptPageError(rid, page, "slot holds another page")
        if out is None:
            return bytearray(buf[_HDR.size : end])
        out[:] = buf[_HDR.size : end]
        return out

    def free(self, rid: str, page: int) -> None:
        with self._lock:
            hit = self._map.pop((rid, page), None)
            if hit is not None:
                self._free.append(hit[0])
                pages = self._by_rid.get(rid)
                if pages is not None:
                    pages.discard(page)
                    if not pages:
                        del self._by_rid[rid]

    def free_request(self, rid: str) -> int:
        """Free every page of `rid`; returns how many slots came back."""
        with self._lock:
            pages = self._by_rid.pop(rid, set())
            for p in pages:
                self._free.append(self._map.pop((rid, p))[0])
            return len(pages)

    def slot_offset(self, rid: str, page: int) -> int:
        """Byte offset of the page's slot in the file (for tests that damage it on purpose)."""
        with self._lock:
            return self._offset(self._map[(rid, page)][0])

    def close(self) -> None:
        """Remove the store's file and release its lock (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        owned.disown(self.path)
        os.close(self.fd)

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
