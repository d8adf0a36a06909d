"""`WriteBehind`: the writer side of `cache.HostPageCache` (read its module doc), mixed into it: dirty pages that
leave the LRU go to a bounded write queue drained by the writer thread outside the lock (back-pressure when it
is over its bound); a failed write keeps the page in DRAM, pinned, retried at the next release; `flush` and
`settle` for tests, benches and shutdown. Every method but the writer loop runs with the cache's lock held
unless it says otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashmemory.offload.disk.store import PageStore

log = logging.getLogger("flashmemory.offload.disk")

Key = tuple[str, int]  # (rid, logical page)


@dataclass
class DiskTierCounters:
    """Monotonic counters of one cache (+ its store); `hit_rate` over gets."""

    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    readahead_late: int = 0  # a get found its read-ahead still queued or in flight: it missed its window
    write_errors: int = 0  # write-behind failures (ENOSPC, EIO, ...): the page stayed in DRAM
    corrupt_pages: int = 0
    evictions: int = 0
    write_waits: int = 0  # puts that waited for the writer (the write queue was over its bound)
    decode_disk_waits: int = 0  # times the decode thread waited on disk I/O (read, back-pressure, sync write)

    @property
    def hit_rate(self) -> float:
        n = self.cache_hits + self.cache_misses
        return self.cache_hits / n if n else 0.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(asdict(self))
        d["hit_rate"] = self.hit_rate
        return d


@dataclass
class CacheEntry:
    """One cached page: its bytes and whether the store lacks them (dirty)."""

    buf: bytearray
    dirty: bool


class WriteBehind:
    """Mixed into `HostPageCache`; the attributes are the cache's (built in its constructor)."""

    store: PageStore
    page_bytes: int
    capacity_pages: int
    write_queue_pages: int
    counters: DiskTierCounters
    pinned_pages: int
    _lock: Any
    _cond: threading.Condition
    _lru: OrderedDict[Key, CacheEntry]
    _pinned: dict[Key, CacheEntry]
    _writing: OrderedDict[Key, CacheEntry]
    _ver: dict[Key, int]
    _ahead: set[Key]
    _writer: threading.Thread | None
    _retry: bool
    _stop: bool
    _busy: Key | None

    _note_wait: Callable[[], None]  # cache.py

    def retry_pinned(self) -> int:
        """Try again to write pages kept in DRAM by a failed write-behind; returns how many are still pinned."""
        with self._lock:
            self._retry_pinned()
            return self.pinned_pages

    def flush(self) -> None:
        """Write every dirty page to the store now (errors pin, as at write-behind): the write queue drains first."""
        with self._lock:
            if self._writing:
                self._note_wait()
            while self._writing and self._writer is not None and self._writer.is_alive():
                self._cond.wait()
            for key, ent in list(self._lru.items()):
                if ent.dirty and not self._write_behind(key, ent):
                    self._pinned[key] = self._lru.pop(key)

    def settle(self, timeout: float | None = 30.0) -> bool:
        """Wait until the writer has written (or pinned) every queued page and finished a requested retry of the
        pinned ones; True when settled (at once without a writer). For tests, benches and shutdown."""
        with self._lock:
            idle = lambda: not (self._writing or self._busy is not None or (self._retry and self._pinned))  # noqa: E731
            return self._cond.wait_for(lambda: idle() or self._writer is None or not self._writer.is_alive(), timeout)

    def _write_behind(self, key: Key, ent: CacheEntry) -> bool:
        try:
            self.store.write(key[0], key[1], ent.buf)
        except OSError as e:
            if key not in self._pinned:
                log.warning(
                    "disk tier: write-behind of page %d of %r failed (%s); kept in host memory",
                    key[1],
                    key[0],
                    e.strerror or e,
                )
            self.counters.write_errors += 1
            return False
        ent.dirty = False
        self.counters.disk_bytes_written += self.page_bytes
        return True

    def _shrink(self) -> None:
        """Bring the LRU back to its bound: clean pages leave DRAM, dirty ones go to the writer's queue (or are
        written now without a writer). Then back-pressure: wait while the queue is over its bound."""
        while len(self._lru) > self.capacity_pages:
            key, ent = self._lru.popitem(last=False)
            self._ahead.discard(key)  # read ahead and gone unused: a later prefetch reads it again
            if not ent.dirty:
                self.counters.evictions += 1
            elif self._writer is not None:
                self._writing[key] = ent
                self._cond.notify_all()
            else:
                self._note_wait()
                if self._write_behind(key, ent):
                    self.counters.evictions += 1
                else:
                    self._pinned[key] = ent  # kept in DRAM, outside the bound, until a retry writes it
        if len(self._writing) > self.write_queue_pages and threading.current_thread() is not self._writer:
            self.counters.write_waits += 1
            self._note_wait()
            while len(self._writing) > self.write_queue_pages and self._writer is not None and self._writer.is_alive():
                self._cond.wait(timeout=1.0)

    def _write_loop(self) -> None:
        """The writer thread: write queued pages (oldest first) outside the lock, then pinned ones when a release
        asked for a retry; a page rewritten meanwhile keeps its newer bytes queued, a freed one leaves the store."""
        with self._lock:
            while True:
                if self._writing:
                    key, ent = next(iter(self._writing.items()))
                    pinned = False
                elif self._retry and self._pinned:
                    key, ent = next(iter(self._pinned.items()))
                    pinned = True
                elif self._stop:
                    return
                else:
                    self._retry = False
                    self._cond.wait()
                    continue
                ver = self._ver.get(key)
                self._busy = key
                self._lock.release()
                err: OSError | None = None
                try:
                    self.store.write(key[0], key[1], ent.buf)
                except OSError as e:
                    err = e
                except Exception as e:  # noqa: BLE001 - a bug must not kill the writer: pin the page, log it
                    log.exception("disk tier: write-behind of %r failed", key)
                    err = OSError(str(e))
                finally:
                    self._lock.acquire()
                    self._busy = None
                self._wrote(key, ent, ver, err, pinned)
                self._cond.notify_all()

    def _wrote(self, key: Key, ent: CacheEntry, ver: int | None, err: OSError | None, pinned: bool) -> None:
        """Writer side, lock held: settle one finished write of `ent` (page version `ver` when it started)."""
        src = self._pinned if pinned else self._writing
        current = src.get(key) is ent and self._ver.get(key) == ver
        if not current:  # rewritten (newer bytes are queued or in the LRU) or freed meanwhile
            if err is None and key not in self._ver:
                self.store.free(*key)  # freed while we wrote: the slot our write took goes back
            return
        if err is None:
            del src[key]
            self.counters.disk_bytes_written += self.page_bytes
            self._written_out(key, ent)
            return
        self.counters.write_errors += 1
        if pinned:
            self._retry = False  # the disk still refuses: keep the rest pinned, try at the next release
            return
        log.warning(
            "disk tier: write-behind of page %d of %r failed (%s); kept in host memory",
            key[1],
            key[0],
            err.strerror or err,
        )
        del self._writing[key]
        self._pinned[key] = ent

    def _retry_pinned(self) -> None:
        for key, ent in list(self._pinned.items()):
            if not self._write_behind(key, ent):
                break  # the disk still refuses: keep the rest pinned, try at the next release
            del self._pinned[key]  # on disk now: leaves DRAM (unless read-ahead wants it)
            self._written_out(key, ent)

    def _written_out(self, key: Key, ent: CacheEntry) -> None:
        """`ent` (out of the write queue or the pinned set) is on disk now: it leaves DRAM, unless read-ahead asked
        for it while it waited (`prefetch` marks such a page without reading it: it was in DRAM); then it stays,
        clean, as the most recently used page, so the read-ahead is not lost."""
        ent.dirty = False
        if key in self._ahead:
            self._lru[key] = ent
            self._shrink()
        else:
            self.counters.evictions += 1
