"""HostPageCache: write-behind and read-ahead, disk full / EIO (counted, nothing lost), a corrupt page failing
only its own request, a read-ahead that misses its window, and concurrent use from several threads."""

from __future__ import annotations

import errno
import random
import threading
import time

import pytest

from flashmemory.offload.disk import CorruptPageError, FaultPlan, FaultyFileOps, HostPageCache, PageStore

PB = 5000


def page(rid: str, i: int, v: int = 0) -> bytes:
    return bytes((hash((rid, i, v)) + j) % 256 for j in range(PB))


@pytest.fixture
def tier(tmp_path):
    ops = FaultyFileOps()
    store = PageStore(str(tmp_path), 16 * 8192, PB, ops=ops)
    cache = HostPageCache(store, 3 * PB)
    yield cache, store, ops
    cache.close()
    store.close()


def test_write_behind_and_read_back(tier) -> None:
    cache, store, _ = tier
    for i in range(8):
        cache.put("a", i, page("a", i))
    cache.check()  # queued for the writer or written: both valid
    assert cache.settle()
    assert len(cache._lru) == 3 and store.used_slots == 5  # 5 written behind, 3 still dirty in DRAM
    assert cache.counters.disk_bytes_written == 5 * PB and cache.counters.evictions == 5
    for i in reversed(range(8)):
        assert bytes(cache.get("a", i)) == page("a", i)
    assert (
        cache.counters.cache_hits == 3 and cache.counters.cache_misses == 5 and cache.counters.disk_bytes_read == 5 * PB
    )
    cache.check()
    assert cache.free_request("a") == 8 and store.used_slots == 0 and len(cache._lru) == 0
    with pytest.raises(KeyError, match="page 0 of request 'a' is not held"):
        cache.get("a", 0)


@pytest.mark.parametrize("fault", ["full", "eio", "slots"])
def test_disk_full_or_eio_is_counted_and_nothing_is_lost(tmp_path, fault: str) -> None:
    ops = FaultyFileOps()
    store = PageStore(str(tmp_path), (2 if fault == "slots" else 16) * 8192, PB, ops=ops)
    cache = HostPageCache(store, 2 * PB)
    if fault == "full":
        ops.plan.full = True
    elif fault == "eio":
        ops.plan.write_errors = [errno.EIO] * 3
    for i in range(6):
        cache.put("r", i, page("r", i))
    cache.check()
    assert cache.settle()
    c = cache.counters
    assert c.write_errors >= 2 and cache.pinned_pages >= 2
    held = len(cache._lru) + cache.pinned_pages
    assert held > cache.capacity_pages  # over the bound by the pinned pages only
    assert len(cache._lru) <= cache.capacity_pages
    for i in range(6):  # nothing lost
        assert bytes(cache.get("r", i)) == page("r", i)
    ops.plan.full = False
    cache.put("s", 0, page("s", 0))
    cache.free_request("s")  # space returns: pinned pages are retried
    assert cache.settle()  # ... by the writer thread
    if fault != "slots":
        assert cache.pinned_pages == 0 and len(cache._lru) <= cache.capacity_pages
        assert all((r, i) in store for r, i in [("r", j) for j in range(6)] if not cache.resident(r, i))
    for i in range(6):
        assert bytes(cache.get("r", i)) == page("r", i)
    cache.check()
    cache.close()
    store.close()


def test_corrupt_page_fails_its_request_only(tier) -> None:
    cache, store, ops = tier
    cache.put("bad", 0, page("bad", 0))
    cache.put("bad", 1, page("bad", 1))
    ops.plan.corrupt = 1
    cache.flush()  # oldest first: "bad" 0 lands with a flipped byte, "bad" 1 fine
    assert ops.injected == {"corrupt": 1}
    for i in range(4):
        cache.put("other", i, page("other", i))  # pushes both "bad" pages out of DRAM
    assert not cache.resident("bad", 0) and not cache.resident("bad", 1)
    with pytest.raises(CorruptPageError, match=r"page 0 of request 'bad' is corrupt on disk") as e:
        cache.get("bad", 0)
    assert (e.value.rid, e.value.page) == ("bad", 0)
    with pytest.raises(CorruptPageError):  # stays an error for that request, never wrong bytes
        cache.get("bad", 0)
    assert bytes(cache.get("bad", 1)) == page("bad", 1)
    assert cache.counters.corrupt_pages == 1
    for i in range(4):
        assert bytes(cache.get("other", i)) == page("other", i)  # the next request is served
    free_before = store.free_slots
    cache.free_request("bad")  # the request is finished: its slots come back
    assert store.free_slots == free_before + 2
    cache.check()


def test_read_ahead_hit_and_late(tier) -> None:
    cache, store, ops = tier
    for i in range(6):
        cache.put("r", i, page("r", i))
    assert cache.settle()
    assert not cache.resident("r", 0)
    gate = threading.Event()
    ops.plan.read_gate = gate
    assert cache.prefetch("r", [0, 1]) == 2

    def open_when_late() -> None:  # the reads arrive only after the get asked: late, still correct
        end = time.monotonic() + 60  # a bound, so a get that never counts fails instead of hanging
        while cache.counters.readahead_late < 1 and time.monotonic() < end:
            time.sleep(0.005)
        gate.set()

    threading.Thread(target=open_when_late, daemon=True).start()
    assert bytes(cache.get("r", 0)) == page("r", 0)
    assert cache.counters.readahead_late == 1
    ops.plan.read_gate = None
    cache.prefetch("r", [2])
    cache.close()  # joins the worker: every queued read-ahead has landed
    hits = cache.counters.cache_hits
    assert cache.resident("r", 2) and bytes(cache.get("r", 2)) == page("r", 2)
    assert cache.counters.cache_hits == hits + 1 and cache.counters.readahead_late == 1


def test_threads_share_the_cache(tmp_path) -> None:
    ops = FaultyFileOps(plan=FaultPlan(delay_s=0.0005))
    store = PageStore(str(tmp_path), 64 * 8192, PB, ops=ops)
    cache = HostPageCache(store, 4 * PB, readers=3)
    errors: list[BaseException] = []

    def client(t: int) -> None:
        rng = random.Random(t)
        try:
            for round_ in range(3):
                rid = f"t{t}-{round_}"
                n = rng.randint(2, 6)
                for i in range(n):
                    cache.put(rid, i, page(rid, i))
                cache.prefetch(rid, list(range(n)))
                for _ in range(10):
                    i = rng.randrange(n)
                    assert bytes(cache.get(rid, i)) == page(rid, i)
                cache.free_request(rid)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    cache.close()
    assert not errors, errors
    cache.check()
    assert store.used_slots == 0 and cache.live_pages() == {}
    store.close()


def test_open_tier_from_the_environment(tmp_path, caplog) -> None:
    from flashmemory.env import DiskTierConfig, FlashMemoryEnv
    from flashmemory.offload.disk import DiskTierError, open_tier

    cfg = FlashMemoryEnv.from_environ(
        {
            "SGLANG_DECODE_SWAP_P": "1",
            "SGLANG_PATHP_DISK_DIR": str(tmp_path),
            "SGLANG_PATHP_DISK_GB": "0.0001",
            "SGLANG_PATHP_HOST_CACHE_GB": "0.00002",
        }
    ).disk
    with caplog.at_level("INFO", logger="flashmemory.offload.disk"):
        cache = open_tier(cfg, PB, rank=3)
    assert cache.capacity_pages == 4 and cache.store.n_slots == 100_000 // 8192
    assert "fm-pagestore-r3-" in cache.store.path and "disk tier (rank 3): 12 pages" in caplog.text
    cache.close()
    cache.store.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DiskTierError, match="SGLANG_PATHP_DISK_DIR=.*not an existing directory"):
        open_tier(DiskTierConfig(dir=str(tmp_path / "gone")), PB)
    with pytest.raises(DiskTierError, match="raise SGLANG_PATHP_HOST_CACHE_GB"):
        open_tier(DiskTierConfig(dir=str(tmp_path), host_cache_gb=1e-9), PB)
    assert list(tmp_path.iterdir()) == []  # the store of the failed start was removed
    with pytest.raises(DiskTierError, match="SGLANG_PATHP_DISK_DIR is not set"):
        open_tier(DiskTierConfig(), PB)


@pytest.mark.parametrize("evict", ["drop_clean", "lru"])
def test_a_read_ahead_page_evicted_before_use_can_be_read_ahead_again(tmp_path, evict) -> None:
    """A page read ahead and evicted before any `get` (a cold cache, or the LRU bound) is read ahead again on the
    next `prefetch` (a stale read-ahead mark once made the next prefetch skip it: the page never landed)."""
    store = PageStore(str(tmp_path), 16 * 8192, PB, ops=FaultyFileOps())
    cache = HostPageCache(store, 2 * PB, worker=False)  # prefetch reads at once, in this thread
    try:
        for i in range(4):
            cache.put("a", i, page("a", i))
        cache.flush()
        cache.drop_clean()
        assert cache.prefetch("a", [0]) == 1 and cache.resident("a", 0)
        if evict == "drop_clean":
            cache.drop_clean()
        else:
            cache.prefetch("a", [1, 2])  # two more pages through a 2-page cache: page 0 leaves
        assert not cache.resident("a", 0)
        assert cache.prefetch("a", [0]) == 1 and cache.resident("a", 0)
        assert bytes(cache.get("a", 0)) == page("a", 0)
        cache.check()
    finally:
        cache.close()
        store.close()


@pytest.mark.parametrize("where", ["write queue", "pinned"])
def test_a_read_ahead_of_a_page_waiting_to_be_written_stays_in_dram(tmp_path, where) -> None:
    """A page queued for the writer (or pinned by a failed write) is in DRAM, so `prefetch` reads nothing; once
    written it must stay in DRAM for the read-ahead that asked for it (it once left DRAM with the write and the
    read-ahead never landed: the next `get` waited on the disk)."""
    gate, ops = threading.Event(), FaultyFileOps()
    store = PageStore(str(tmp_path), 16 * 8192, PB, ops=ops)
    ops.plan.write_gate = gate  # the writer's writes block until set
    ops.plan.full = where == "pinned"  # every write fails: the page is pinned in DRAM
    cache = HostPageCache(store, 1 * PB, write_queue_pages=4)
    try:
        cache.put("a", 0, page("a", 0))
        cache.put("a", 1, page("a", 1))  # page 0 leaves the 1-page LRU for the write queue
        if where == "pinned":
            gate.set()
            assert cache.settle() and cache.pinned_pages == 1
        assert cache.resident("a", 0) and cache.prefetch("a", [0]) == 0  # in DRAM: nothing to read
        ops.plan.full = False
        gate.set()
        if where == "pinned":
            assert cache.retry_pinned() == 0
        assert cache.settle() and cache.counters.disk_bytes_written >= PB
        assert cache.resident("a", 0)  # written, and still in DRAM for the read-ahead
        misses = cache.counters.cache_misses
        assert bytes(cache.get("a", 0)) == page("a", 0) and cache.counters.cache_misses == misses
        cache.check()
    finally:
        gate.set()
        cache.close()
        store.close()
