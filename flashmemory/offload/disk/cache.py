"""`HostPageCache`: a bounded LRU of page buffers in host DRAM in front of a `PageStore`.

- `put(rid, page, data)` admits a page (landed by PD or written by decode) as dirty; when the cache is over its
  bound, the least recently used unpinned pages leave it: clean ones are dropped (the store holds them), dirty
  ones are written behind to the store first, on the writer thread: they move to a write queue (still readable,
  still in DRAM) bounded by `write_queue_pages`. Back-pressure: a `put` that finds the queue over its bound waits
  for the writer (counted as `write_waits`, and as `decode_disk_waits` on the decode thread), so host memory
  stays bounded (LRU + queue + pinned pages). Without a worker (`worker=False`) the write runs in `put`.
- `prefetch(rid, pages)` queues read-ahead on the worker thread (Level 1's picks for the next tau window);
  `get(rid, page)` returns the page, waiting for a read in flight or reading it itself.
- A page that fails verification raises `CorruptPageError(rid, page)` from `get` for that request only (until it
  is freed); other requests are unaffected.
- ENOSPC / EIO at write-behind: the page stays in DRAM, pinned (moved out of the LRU into `_pinned`: the cache
  goes over its bound by the pinned pages only) and counted; every `free_request` (space may have come back) has
  the writer retry them, oldest first, dropping them from DRAM once on disk (`retry_pinned()` does it now).
- `decode_thread`: the ident of the thread that decodes (set by the engine). Every time that thread waits on disk
  I/O (a read in `get`, a back-pressured `put`, a synchronous write) `decode_disk_waits` counts it: read-ahead
  and the writer keep it at 0 in the normal path.

Invariants (checked by `check()`): every live page is in the LRU, pinned, queued for the writer, or in the store;
the LRU never holds more than `capacity_pages`; a clean page in the LRU is also in the store; a pinned or queued
page is dirty and in neither the LRU nor the other.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict

from flashmemory.offload.disk.store import CorruptPageError, DiskTierError, PageStore
from flashmemory.offload.disk.writer import CacheEntry, DiskTierCounters, Key, WriteBehind

log = logging.getLogger("flashmemory.offload.disk")


class HostPageCache(WriteBehind):
    """Pages of `store.page_bytes` bytes, keyed (rid, page); at most `capacity_bytes // page_bytes` in the LRU,
    plus the pinned ones. Eviction is O(1) per page.

    Thread-safe. `readers` read-ahead threads and one writer thread (none with worker=False: `prefetch` reads at
    once and write-behind runs under the lock in the thread that overflows the cache). Disk reads and the
    writer's writes run outside the lock; a page's version tells a finished transfer whether its page was
    rewritten or freed meanwhile. write_queue_pages: bound of the write queue (0 = max(8, capacity // 4)).
    """

    def __init__(
        self, store: PageStore, capacity_bytes: int, worker: bool = True, readers: int = 1, write_queue_pages: int = 0
    ):
        self.store = store
        self.page_bytes = store.page_bytes
        self.capacity_pages = capacity_bytes // self.page_bytes
        if self.capacity_pages < 1:
            raise DiskTierError(
                f"disk tier: a host cache of {capacity_bytes} B holds no {self.page_bytes}-B page "
                "(raise SGLANG_PATHP_HOST_CACHE_GB)"
            )
        self.counters = DiskTierCounters()
        self._lock = threading.Lock()
        self._lru: OrderedDict[Key, CacheEntry] = OrderedDict()
        self._pinned: dict[Key, CacheEntry] = {}  # dirty pages whose write-behind failed, oldest first
        self._live: dict[str, set[int]] = {}
        self._ver: dict[Key, int] = {}
        self._next_ver = 0
        self._loading: dict[Key, threading.Event] = {}
        self._failed: dict[Key, BaseException] = {}
        self._ahead: set[Key] = set()
        self._q: queue.Queue[Key | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self.write_queue_pages = write_queue_pages or max(8, self.capacity_pages // 4)
        self._writing: OrderedDict[Key, CacheEntry] = OrderedDict()  # dirty pages out of the LRU, oldest first
        self._cond = threading.Condition(self._lock)  # the writer and back-pressured puts wait here
        self._retry = False  # the writer retries pinned pages when set
        self._stop = False
        self._busy: Key | None = None  # the page whose write is in flight
        self.decode_thread: int | None = None
        self._writer: threading.Thread | None = None
        if worker:
            self._writer = threading.Thread(target=self._write_loop, name="fm-disk-writer", daemon=True)
            self._writer.start()
        if worker:  # `readers` threads share one queue (more reads in flight: a deeper device queue)
            for i in range(max(1, readers)):
                t = threading.Thread(target=self._work, name=f"fm-disk-readahead-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    # -- admission and lookup ----------------------------------------------------------------------
    @property
    def pinned_pages(self) -> int:
        return len(self._pinned)

    def resident(self, rid: str, page: int) -> bool:
        """In DRAM (LRU, pinned, or queued for the writer)."""
        key = (rid, page)
        return key in self._lru or key in self._pinned or key in self._writing

    @property
    def queued_writes(self) -> int:
        return len(self._writing)

    def _note_wait(self) -> None:
        """The calling thread is about to wait on disk I/O: count it if it is the decode thread (lock held)."""
        if self.decode_thread is not None and threading.get_ident() == self.decode_thread:
            self.counters.decode_disk_waits += 1

    def live_pages(self) -> dict[str, set[int]]:
        with self._lock:
            return {r: set(p) for r, p in self._live.items()}

    def put(self, rid: str, page: int, data: bytes | bytearray | memoryview) -> None:
        """Admit (or overwrite) a page; it is dirty until written behind. data: exactly page_bytes bytes."""
        self._put(rid, page, data, wait=True)

    def try_put(self, rid: str, page: int, data: bytes | bytearray | memoryview) -> bool:
        """`put` unless it could wait on the writer: False, with nothing changed, while the write queue is at its
        bound (with a writer). For a caller that must never block on disk (the decode thread's seals in shrink
        mode): the page stays where it is and is offered again later."""
        return self._put(rid, page, data, wait=False)

    def _put(self, rid: str, page: int, data: bytes | bytearray | memoryview, wait: bool) -> bool:
        buf = bytearray(memoryview(data).cast("B"))
        if len(buf) != self.page_bytes:
            raise ValueError(f"HostPageCache.put: {len(buf)} B for a {self.page_bytes}-B page")
        key = (rid, page)
        with self._lock:
            if not wait and self._writer is not None and len(self._writing) >= self.write_queue_pages:
                return False
            self._next_ver += 1
            self._ver[key] = self._next_ver
            self._lru.pop(key, None)  # new bytes replace old ones (a pinned or queued copy too: written behind)
            self._pinned.pop(key, None)
            self._writing.pop(key, None)
            self._lru[key] = CacheEntry(buf, dirty=True)
            self._failed.pop(key, None)
            self._live.setdefault(rid, set()).add(page)
            self._shrink()
        return True

    def wait_room(self, timeout: float | None = 30.0) -> bool:
        """Wait until the write queue is at most half full (at once without a writer). A background producer (the
        queued-pages worker) calls it before each `put`, so the other half stays free for the decode thread's
        seals: they never meet back-pressure because of it. True when there is room."""
        with self._lock:
            room = lambda: len(self._writing) <= self.write_queue_pages // 2  # noqa: E731
            alive = lambda: self._writer is not None and self._writer.is_alive()  # noqa: E731
            return self._cond.wait_for(lambda: room() or not alive(), timeout) and room()

    def get(self, rid: str, page: int) -> memoryview:
        """The page's bytes (read-only view, page_bytes). Blocks while its read is in flight. KeyError: not a
        live page; CorruptPageError: the disk copy failed verification (this request only)."""
        key = (rid, page)
        counted = False  # one get counts once: a hit, or a miss (+ late) followed by the read it waited for
        while True:
            with self._lock:
                if page not in self._live.get(rid, ()):
                    raise KeyError(f"disk tier: page {page} of request {rid!r} is not held")
                if key in self._failed:
                    raise self._failed[key]
                ent = self._lru.get(key)
                if ent is not None:
                    self._lru.move_to_end(key)
                ent = ent or self._pinned.get(key) or self._writing.get(key)
                if ent is not None:
                    self.counters.cache_hits += not counted
                    self._ahead.discard(key)
                    return memoryview(ent.buf).toreadonly()
                if key in self._ahead:  # read-ahead asked for it but it has not arrived: it missed its window
                    self._ahead.discard(key)
                    self.counters.readahead_late += 1
                if not counted:
                    self.counters.cache_misses += 1
                    self._note_wait()
                counted = True
                ev = self._loading.get(key)
                if ev is None:
                    ver = self._ver[key]
                    ev = self._loading[key] = threading.Event()
                    mine = True
                else:
                    mine = False
            if mine:
                self._load(key, ver, ev)
            else:
                ev.wait()

    def peek(self, rid: str, page: int) -> bytes:
        """The page's bytes for checks (`offload.check`): from DRAM, else read from the store, touching no counter
        and no LRU order. KeyError: not a live page; CorruptPageError as `get`."""
        with self._lock:
            if page not in self._live.get(rid, ()):
                raise KeyError(f"disk tier: page {page} of request {rid!r} is not held")
            ent = self._lru.get((rid, page)) or self._pinned.get((rid, page)) or self._writing.get((rid, page))
            if ent is not None:
                return bytes(ent.buf)
            return bytes(self.store.read(rid, page))

    def prefetch(self, rid: str, pages: list[int]) -> int:
        """Queue read-ahead of these pages into the cache; returns how many reads were queued (pages not in DRAM). A
        page queued for the writer or pinned is in DRAM: it is only marked, and stays in DRAM once written."""
        n = 0
        with self._lock:
            live = self._live.get(rid, set())
            for p in pages:
                key = (rid, p)
                if p not in live or key in self._loading or key in self._ahead or key in self._lru:
                    continue
                self._ahead.add(key)  # queued for the writer or pinned: marked, so it stays in DRAM once written
                if key not in self._writing and key not in self._pinned:
                    self._q.put(key)
                    n += 1
        if not self._threads:  # no worker (tests, single-threaded tools): read ahead now
            self.drain()
        return n

    def drain(self) -> None:
        """Run the queued read-ahead in this thread (used when there is no worker)."""
        while True:
            try:
                key = self._q.get_nowait()
            except queue.Empty:
                return
            if key is not None:
                self._prefetch_one(key)

    # -- release -----------------------------------------------------------------------------------
    def free_request(self, rid: str) -> int:
        """Drop every page of `rid` from DRAM and the store (space returns); then retry pinned pages."""
        with self._lock:
            pages = self._live.pop(rid, set())
            for p in pages:
                key = (rid, p)
                self._lru.pop(key, None)
                self._pinned.pop(key, None)
                self._writing.pop(key, None)
                self._ver.pop(key, None)
                self._failed.pop(key, None)
                self._ahead.discard(key)
            while self._busy is not None and self._busy[0] == rid:  # a write of ours holds a slot: let it land
                self._cond.wait()
            self.store.free_request(rid)
            if self._writer is None:
                self._retry_pinned()
            else:  # space came back: the writer retries the pinned pages, not this (decode) thread
                self._retry = bool(self._pinned)
                self._cond.notify_all()
        return len(pages)

    def drop_clean(self) -> int:
        """Drop every clean, unpinned page from DRAM (they stay on disk): a cold cache. Returns how many went."""
        with self._lock:
            gone = [k for k, e in self._lru.items() if not e.dirty]
            for k in gone:
                del self._lru[k]
            self._ahead.difference_update(gone)  # read ahead and gone unused: a later prefetch reads it again
            self.counters.evictions += len(gone)
            return len(gone)

    def close(self) -> None:
        """Stop the read-ahead threads after the reads already queued, and the writer after the queued writes
        (idempotent)."""
        if self._writer is not None:
            with self._lock:
                self._stop = True
                self._cond.notify_all()
            self._writer.join(timeout=30)
            self._writer = None
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

    # -- internals (caller holds self._lock unless stated) ----------------------------------------
    def _prefetch_one(self, key: Key) -> None:
        """Worker side of read-ahead (no lock held on entry)."""
        with self._lock:
            if key not in self._ahead or self.resident(*key) or key in self._loading or key not in self._ver:
                return
            ver = self._ver[key]
            ev = self._loading[key] = threading.Event()
        self._load(key, ver, ev)

    def _load(self, key: Key, ver: int, ev: threading.Event) -> None:
        """Read `key` from the store outside the lock and insert it if it is still the same live page."""
        data: bytearray | None = None
        err: BaseException | None = None
        try:
            data = self.store.read(key[0], key[1])  # type: ignore[assignment]
        except KeyError:
            pass  # freed (or never written) meanwhile
        except Exception as e:  # CorruptPageError, or a bug: handed to this page's reader, never swallowed
            err = e
        with self._lock:
            try:
                if self._ver.get(key) != ver or self.resident(*key):
                    return  # freed or rewritten while we read: the bytes we read are not the page any more
                if err is not None:
                    self._failed[key] = err
                    self.counters.corrupt_pages += isinstance(err, CorruptPageError)
                    if not isinstance(err, CorruptPageError):
                        log.error("disk tier: reading page %d of %r failed: %r", key[1], key[0], err)
                elif data is None:
                    self._failed[key] = CorruptPageError(key[0], key[1], "neither in host memory nor on disk")
                else:
                    self.counters.disk_bytes_read += self.page_bytes
                    self._lru[key] = CacheEntry(data, dirty=False)
                    self._shrink()
            finally:
                self._loading.pop(key, None)
                ev.set()

    def _work(self) -> None:
        while True:
            key = self._q.get()
            if key is None:
                return
            try:
                self._prefetch_one(key)
            except Exception:  # keep read-ahead alive; the page's get reads it itself
                log.exception("disk tier: read-ahead of %r failed", key)

    # -- invariants (tests, debugging) ---------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring)."""
        with self._lock:
            assert len(self._lru) <= self.capacity_pages, (len(self._lru), self.capacity_pages)
            for (rid, page), ent in self._writing.items():
                assert page in self._live.get(rid, ()), f"dead queued page {page} of {rid!r}"
                assert ent.dirty and (rid, page) not in self._lru and (rid, page) not in self._pinned, (
                    f"queued page {page} of {rid!r} clean, in the LRU or pinned"
                )
            for (rid, page), ent in self._lru.items():
                assert page in self._live.get(rid, ()), f"dead page {page} of {rid!r} in DRAM"
                assert ent.dirty or (rid, page) in self.store, f"clean page {page} of {rid!r} not on disk"
                assert (rid, page) not in self._pinned, f"page {page} of {rid!r} both pinned and in the LRU"
            for (rid, page), ent in self._pinned.items():
                assert page in self._live.get(rid, ()), f"dead pinned page {page} of {rid!r}"
                assert ent.dirty, f"pinned page {page} of {rid!r} is clean"
            for rid, pages in self._live.items():
                for p in pages:
                    assert self.resident(rid, p) or (rid, p) in self.store, f"page {p} of {rid!r} lost"
