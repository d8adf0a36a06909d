"""Queued requests' landed pages under a DRAM cap (shrink mode with the disk tier).

On a PD decode server a request's KV lands in the sparse host mirror when its transfer completes; it then waits
in sglang's decode waiting queue until a running slot frees. Those landed pages are DRAM the engine does not own
yet. `QueuedPages` keeps them under `cap_bytes`:

  update    the scheduler thread hands over the waiting queue in order (rid, pool pages) and how many of its
            head run next. New rids are recorded as landed; rids that left the queue (admitted, or aborted) are
            forgotten. When landed pages of the queue exceed the cap, requests from the queue's tail (never one
            that runs next) are parked: on the worker thread their pages are packed (`format.pack_rows`) into
            the tier (keys (rid, logical page); the host page cache writes them behind to the store) and then
            `SparseMirror.park` hands their OS pages back.
  restore   a parked request that runs next is held back (`update` returns it) while the worker reads its pages
            back through the tier (read-ahead of the whole request first, then one `get` per page: a miss reads
            the store and verifies the checksum) and `SparseMirror.unpark` writes them at their addresses; then
            its tier copy is freed (the engine seals the running request again from its second step) and it is
            ready: the admission's warm start reads DRAM, so the decode thread never waits on disk for it.
  failure   a page that cannot be read back or fails verification fails that request only: `refusal(rid)` names
            request and page, and the adapter refuses its admission (sglang aborts it); others are untouched.

States of a recorded rid: landed -> parking -> parked -> restoring -> ready (or failed). Thread safety: one lock
(`self._lock`) guards the records; every mirror change (park, unpark, forget) runs under `mirror_lock` (the
engine's lock), so it never interleaves with the engine's claims and frees of mirror pages. The worker is the
only thread that touches the tier for queued requests; nothing here runs on the decode thread but `update`,
`refusal` and `held_bytes` (dictionary work, no I/O).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from flashmemory.offload.disk.cache import HostPageCache
from flashmemory.offload.disk.format import pack_rows, unpack_rows
from flashmemory.offload.disk.sparse_mirror import SparseMirror
from flashmemory.offload.disk.store import CorruptPageError
from flashmemory.offload.layout import OffloadLayout

log = logging.getLogger("flashmemory.offload.disk")

LANDED, PARKING, PARKED, RESTORING, READY, FAILED = "landed", "parking", "parked", "restoring", "ready", "failed"


@dataclass
class _Queued:
    """One waiting request: its pool pages (logical page i = mirror page pages[i]) and where its bytes are."""

    pages: tuple[int, ...]
    state: str = LANDED
    error: str = ""
    gone: bool = False  # left the queue while the worker held it: the worker cleans up


@dataclass
class QueuedCounters:
    """Running totals of one `QueuedPages`."""

    parked_requests: int = 0
    parked_pages: int = 0
    restored_pages: int = 0
    restore_failures: int = 0
    held_back: int = 0  # `update` calls that held a request back from admission (its pages not in DRAM yet)


class QueuedPages:
    """Keeps the queued requests' landed pages in `mirror` under `cap_bytes` (see the module doc).

    mirror: the engine's `SparseMirror` (slot == page id); tier: the engine's `HostPageCache` (page bytes =
    disk_page_bytes(layout)); mirror_lock: the engine's lock; worker=False runs each task inside `update`
    (tests, single-threaded tools)."""

    def __init__(
        self,
        mirror: SparseMirror,
        tier: HostPageCache,
        layout: OffloadLayout,
        cap_bytes: int,
        mirror_lock: AbstractContextManager,
        worker: bool = True,
    ):
        self.mirror, self.tier, self.layout, self.cap_bytes = mirror, tier, layout, cap_bytes
        self.page_bytes = layout.n_layers * layout.kv_page_bytes + len(layout.offload_index_layers) * (
            layout.index_page_bytes
        )
        self.mirror_lock = mirror_lock
        self.counters = QueuedCounters()
        self._reqs: dict[str, _Queued] = {}
        self._lock = threading.Lock()
        self._q: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if worker:
            self._thread = threading.Thread(target=self._loop, name="fm-disk-queued", daemon=True)
            self._thread.start()

    # ---- the scheduler thread ------------------------------------------------------------------------
    def known(self, rid: str) -> bool:
        with self._lock:
            return rid in self._reqs

    def update(self, order: Sequence[tuple[str, Sequence[int] | None]], n_next: int) -> set[str]:
        """The waiting queue now, in order: (rid, its pool pages, or None when already `known`); its first
        `n_next` run next. Returns the rids among those to hold back (their pages are not in DRAM yet)."""
        tasks: list[tuple[str, str]] = []
        held: set[str] = set()
        with self._lock:
            live = {rid for rid, _ in order}
            for rid in [r for r in self._reqs if r not in live]:
                self._leave(rid, tasks)
            for rid, pages in order:
                if rid not in self._reqs and pages is not None:
                    self._reqs[rid] = _Queued(tuple(int(p) for p in pages))
            head = [rid for rid, _ in order[:n_next] if rid in self._reqs]
            for rid in head:
                q = self._reqs[rid]
                if q.state == PARKED:
                    q.state = RESTORING
                    tasks.append(("restore", rid))
                if q.state in (PARKING, RESTORING):
                    held.add(rid)  # a parking request is restored as soon as its parking is done
            over = self._landed_pages() * self.page_bytes - self.cap_bytes
            for rid, _ in reversed(order[n_next:]):
                if over <= 0:
                    break
                q = self._reqs.get(rid)
                if q is not None and q.state == LANDED and q.pages:
                    q.state = PARKING
                    tasks.append(("park", rid))
                    over -= len(q.pages) * self.page_bytes
            self.counters.held_back += bool(held)
        for t in tasks:
            self._submit(t)
        return held

    def refusal(self, rid: str) -> str | None:
        """Why request `rid` cannot be admitted now (its pages failed to come back, or are not in DRAM), else None."""
        with self._lock:
            q = self._reqs.get(rid)
            if q is None or q.state in (LANDED, READY):
                return None
            if q.state == FAILED:
                return q.error
            return f"disk tier: request {rid}'s queued pages are {q.state}, not back in host DRAM"

    def held_bytes(self) -> int:
        """DRAM the queued requests' landed pages take now (landed or restored pages x page bytes)."""
        with self._lock:
            return self._landed_pages() * self.page_bytes

    def state(self, rid: str) -> str | None:
        with self._lock:
            q = self._reqs.get(rid)
            return None if q is None else q.state

    def _landed_pages(self) -> int:
        return sum(len(q.pages) for q in self._reqs.values() if q.state in (LANDED, READY, RESTORING))

    def _leave(self, rid: str, tasks: list[tuple[str, str]]) -> None:
        """`rid` left the waiting queue (caller holds the lock): admitted (ready or landed), or aborted. A record
        the worker holds, or a parked one (its tier copy is dropped by a task), is cleaned up on the worker."""
        q = self._reqs[rid]
        if q.state in (PARKING, RESTORING, PARKED):
            if q.state == PARKED and not q.gone:
                with self.mirror_lock:  # now: sglang may hand its pool pages to a new transfer at once
                    self.mirror.forget_parked(list(q.pages))
                tasks.append(("forget", rid))
            q.gone = True
            return
        del self._reqs[rid]

    # ---- the worker ----------------------------------------------------------------------------------
    def _submit(self, task: tuple[str, str]) -> None:
        if self._thread is None:
            self._run(task)
        else:
            self._q.put(task)

    def drain(self) -> None:
        """Wait until every submitted task has run (tests, shutdown)."""
        if self._thread is not None:
            self._q.join()

    def close(self) -> None:
        """Stop the worker after the tasks already queued (idempotent)."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        while True:
            task = self._q.get()
            try:
                if task is None:
                    return
                self._run(task)
            except Exception:  # noqa: BLE001 - a worker bug must not kill the thread silently
                log.exception("disk tier: queued-pages task %s failed", task)
            finally:
                self._q.task_done()

    def _run(self, task: tuple[str, str]) -> None:
        kind, rid = task
        with self._lock:
            q = self._reqs.get(rid)
        if q is None:
            return
        if kind == "park":
            self._park(rid, q)
        elif kind == "restore":
            self._restore(rid, q)
        else:
            self._forget(rid, q)

    def _park(self, rid: str, q: _Queued) -> None:
        """Pages -> tier, then their OS pages go back; a restore asked meanwhile follows at once."""
        m = self.mirror
        try:
            for i, p in enumerate(q.pages):
                self.tier.wait_room()  # half the write queue stays free for the decode thread's seals
                self.tier.put(rid, i, pack_rows(m.kv[:, p], m.index[:, p]))
        except Exception as e:  # noqa: BLE001 - the bytes stay in DRAM: the request runs from them
            log.warning("disk tier: could not park request %s (%s: %s); its pages stay in DRAM", rid, type(e), e)
            self.tier.free_request(rid)
            with self._lock:
                q.state = LANDED
                self._done(rid, q)
            return
        with self._lock:
            gone = q.gone
            if gone:
                self._done(rid, q)
            else:
                with self.mirror_lock:
                    m.park(list(q.pages))
                q.state = PARKED
                log.info(
                    "disk tier: queued request %s: %d landed pages wait in the tier (over the cap)", rid, len(q.pages)
                )
                self.counters.parked_requests += 1
                self.counters.parked_pages += len(q.pages)
        if gone:
            self.tier.free_request(rid)

    def _restore(self, rid: str, q: _Queued) -> None:
        """Tier -> the pages' addresses in the mirror (read-ahead first); a failure fails this request only."""
        self.tier.prefetch(rid, list(range(len(q.pages))))
        err: str | None = None
        for i, p in enumerate(q.pages):
            try:
                kv, ix = unpack_rows(self.tier.get(rid, i), self.layout)
            except CorruptPageError as e:  # a checksum mismatch, or a read error (the cache names which)
                err = f"disk tier: queued request {rid}'s page {i} could not be read back before it runs: {e}"
            except Exception as e:  # noqa: BLE001 - an unreadable page fails its request, like a corrupt one
                err = f"disk tier: queued request {rid}'s page {i} could not be read back before it runs: {e!r}"
            if err is not None:
                break
            with self._lock, self.mirror_lock:
                if q.gone:
                    break
                self.mirror.unpark(p, kv, ix)
                self.counters.restored_pages += 1
        self.tier.free_request(rid)
        with self._lock:
            if err is not None:
                q.state, q.error = FAILED, err
                self.counters.restore_failures += 1
                log.error("%s; that request fails, the others are untouched", err)
            else:
                q.state = READY
                log.info(
                    "disk tier: queued request %s: %d pages read back into host DRAM before it runs", rid, len(q.pages)
                )
            if err is not None or q.gone:  # pages not written back are plain free pages from now on
                with self.mirror_lock:
                    self.mirror.forget_parked(list(q.pages))
            if q.gone:
                self._done(rid, q)

    def _forget(self, rid: str, q: _Queued) -> None:
        """A parked request left the queue without running: its tier copy goes, its pages are plain free pages."""
        self.tier.free_request(rid)
        with self._lock, self.mirror_lock:
            self.mirror.forget_parked(list(q.pages))
            self._done(rid, q)

    def _done(self, rid: str, q: _Queued) -> None:
        """Drop the record if it left the queue (caller holds the lock)."""
        if q.gone and self._reqs.get(rid) is q:
            del self._reqs[rid]
