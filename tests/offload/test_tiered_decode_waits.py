"""The decode thread never waits on disk in the normal path, and every wait is counted (`disk_decode_waits`).

- Sealing and write-behind from the decode thread's `sync_batch` queue writes for the writer thread: 0 waits.
- A recall on the Level-1 worker reads cold pages there: 0 waits on the decode thread.
- Lockstep (the copy runs on the decode thread): read-ahead issued when the selection is known (the worker's
  `recaller.prefetch`) has the pages in host memory before the copy: 0 waits, all cache hits.
- Forced (a cold page, reads held back, the copy on the decode thread): counted.
- Level 1 in lockstep issues that read-ahead on its worker, before the decode thread's publish.
"""

from __future__ import annotations

import threading
import time

import torch

from flashmemory.offload import OffloadEngine, RecallRequest
from flashmemory.offload.disk import FaultyFileOps, HostPageCache, PageStore, disk_page_bytes
from flashmemory.offload.tiered_mirror import TieredEngine
from flashmemory.residency.level1 import AllPass, Level1, Level1Config
from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy
from tests.offload.test_tiered_mirror import CFG, LAYOUT, admit_step, decode_step


def requests(eng, picks: dict[int, list[int]]) -> list[RecallRequest]:
    snap = eng.snapshot_rows()
    return [RecallRequest(r, snap[r][0], tuple(p), tuple(float(x) for x in p)) for r, p in picks.items()]


def on_worker(fn, *args) -> None:
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()


def landed(eng, picks: dict[int, list[int]], timeout: float = 30.0) -> None:
    """Wait until the picked pages are in host memory (asked once: a page then still queued for the writer stays in
    DRAM once written, for the read-ahead that asked for it)."""
    end = time.monotonic() + timeout
    keys = [(str(eng.rows[r].rid), p) for r, ps in picks.items() for p in ps]
    while not all(eng.tier.resident(*k) for k in keys) and time.monotonic() < end:
        time.sleep(0.005)
    c = eng.tier
    assert all(c.resident(*k) for k in keys), (
        f"read-ahead did not land: {keys}; LRU {list(c._lru)}, writing {list(c._writing)}, ahead {sorted(c._ahead)}, "
        f"loading {list(c._loading)}, queued {c._q.qsize()}, failed {dict(c._failed)}"
    )


def test_decode_thread_waits_are_zero_normally_and_counted_when_forced(tmp_path) -> None:
    ops = FaultyFileOps()
    pb = disk_page_bytes(LAYOUT)
    store = PageStore(str(tmp_path), 64 * (pb + 8192), pb, ops=ops)
    # a write queue that holds one step's sealed pages: the writer keeps up, no back-pressure
    eng = TieredEngine(LAYOUT, CFG, HostPageCache(store, 4 * pb, readers=2, write_queue_pages=16))
    g = torch.Generator().manual_seed(4)
    try:
        admit_step((eng,), [(0, "a", 30), (1, "b", 26)], g)
        for _ in range(3):
            decode_step((eng,), [0, 1], g)  # seals 7 + 6 pages into a 4-page cache: written behind
        assert eng.tier.settle() and eng.tier_stats()["disk_bytes_written"] > 0
        assert eng.tier_stats()["disk_decode_waits"] == 0
        eng.tier.drop_clean()  # a cold cache: every sealed page is on disk only
        on_worker(eng.recaller.recall, requests(eng, {0: [0, 1], 1: [0, 1]}))  # the async worker's cycle
        st = eng.tier_stats()
        assert st["disk_bytes_read"] > 0 and st["disk_decode_waits"] == 0
        picks = {0: [2, 3], 1: [2, 3]}  # lockstep: selection known on the worker, copy on decode
        eng.tier.drop_clean()
        on_worker(eng.recaller.prefetch, requests(eng, picks))
        landed(eng, picks)
        hits = eng.tier_stats()["disk_cache_hits"]
        assert eng.tier_stats()["disk_readahead_pages"] >= 1  # the picks not in DRAM (some may wait for the writer)
        eng.recaller.recall(requests(eng, picks))  # this (decode) thread copies: all in host memory
        st = eng.tier_stats()
        assert st["disk_decode_waits"] == 0 and st["disk_cache_hits"] == hits + 4
        eng.tier.drop_clean()  # forced: cold pages, reads held back, copy on decode
        gate = threading.Event()
        ops.plan.read_gate = gate
        threading.Timer(0.2, gate.set).start()
        eng.recaller.recall(requests(eng, {0: [4], 1: [4]}))
        ops.plan.read_gate = None
        assert eng.tier_stats()["disk_decode_waits"] >= 1
    finally:
        eng.close()


def test_lockstep_level1_reads_ahead_on_its_worker() -> None:
    eng = OffloadEngine(LAYOUT, CFG)
    calls: list[tuple[int, int]] = []  # (thread ident, requests)
    eng.recaller.prefetch = lambda reqs: calls.append((threading.get_ident(), len(reqs))) or 0
    g = torch.Generator().manual_seed(5)
    admit_step((eng,), [(0, "a", 30)], g)
    policy = ThresholdPagePolicy(SelectionConfig(threshold=0.0, last_keep=4, kmax=4, page_chunks=4))
    l1 = Level1(eng, AllPass(), policy, Level1Config(tau=2, max_resident_pages=4, last_keep=4, publish_lag=2))
    try:
        for _ in range(4):
            l1.on_step([0], {1: torch.zeros(1, 8)}, torch.zeros(1, dtype=torch.long))
        l1.wait()
    finally:
        l1.close()
    assert calls and all(tid != threading.get_ident() and n == 1 for tid, n in calls)
    assert eng.metrics()["total"]["recall_pages"] > 0
