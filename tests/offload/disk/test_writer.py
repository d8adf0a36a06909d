"""Write-behind on the cache's writer thread: a put never writes to disk itself, the queue is bounded
(back-pressure: the producer waits, counted), queued pages stay readable, and the decode thread's waits on disk
I/O are counted (`decode_disk_waits`): 0 while the writer and read-ahead keep up, > 0 when forced."""

from __future__ import annotations

import threading
import time

import pytest

from flashmemory.offload.disk import FaultyFileOps, HostPageCache, PageStore

PB = 5000


def page(rid: str, i: int) -> bytes:
    return bytes((hash((rid, i)) + j) % 256 for j in range(PB))


@pytest.fixture
def stalled(tmp_path):
    """A cache of 2 pages with a write queue of 2 over a drive whose writes block until `gate` is set."""
    gate, ops = threading.Event(), FaultyFileOps()
    store = PageStore(str(tmp_path), 32 * 8192, PB, ops=ops)
    ops.plan.write_gate = gate  # after the store's marker block is written
    cache = HostPageCache(store, 2 * PB, write_queue_pages=2)
    cache.decode_thread = threading.get_ident()  # this test's thread plays the decode thread
    yield cache, store, gate
    gate.set()
    cache.close()
    store.close()


def test_put_queues_write_behind_without_writing(stalled) -> None:
    cache, store, gate = stalled
    for i in range(4):  # 2 in the LRU, 2 queued for the writer (one of them in flight, blocked)
        cache.put("a", i, page("a", i))
    assert store.used_slots <= 1 and cache.counters.disk_bytes_written == 0
    assert cache.queued_writes + len(cache._lru) == 4 and cache.counters.write_waits == 0
    assert cache.counters.decode_disk_waits == 0
    for i in range(4):  # queued pages are still served from DRAM
        assert bytes(cache.get("a", i)) == page("a", i)
    assert cache.counters.cache_misses == 0
    cache.check()
    gate.set()
    assert cache.settle()
    assert store.used_slots == 2 and cache.counters.disk_bytes_written == 2 * PB and cache.queued_writes == 0
    cache.check()


def test_a_full_queue_makes_the_producer_wait(stalled) -> None:
    cache, store, gate = stalled
    for i in range(4):
        cache.put("a", i, page("a", i))
    done = threading.Event()

    def producer() -> None:  # another thread: the writer's queue is full, so its put waits
        cache.put("a", 4, page("a", 4))
        done.set()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    end = time.monotonic() + 30
    while cache.counters.write_waits < 1 and time.monotonic() < end:
        time.sleep(0.005)
    assert cache.counters.write_waits == 1 and not done.is_set()
    assert len(cache._lru) <= cache.capacity_pages and cache.queued_writes <= cache.write_queue_pages + 1
    assert cache.counters.decode_disk_waits == 0  # the producer is not the decode thread
    gate.set()
    t.join(timeout=30)
    assert done.is_set() and cache.settle()
    for i in range(5):
        assert bytes(cache.get("a", i)) == page("a", i)
    cache.check()


def test_the_decode_thread_waiting_on_disk_is_counted(stalled) -> None:
    cache, store, gate = stalled
    for i in range(4):
        cache.put("a", i, page("a", i))
    threading.Timer(0.2, gate.set).start()
    cache.put("a", 4, page("a", 4))  # the decode thread itself is back-pressured: one wait
    assert cache.counters.decode_disk_waits == 1 and cache.counters.write_waits == 1
    assert cache.settle()
    cache.drop_clean()
    cold = [i for i in range(5) if not cache.resident("a", i)]
    assert cold
    threading.Thread(target=cache.get, args=("a", cold[0])).start()  # another thread's read: not counted
    time.sleep(0.1)
    before = cache.counters.decode_disk_waits
    assert bytes(cache.get("a", cold[-1])) == page("a", cold[-1])  # a read on the decode thread: counted
    assert cache.counters.decode_disk_waits == before + 1


def test_free_request_waits_for_its_write_in_flight(stalled) -> None:
    """A request freed while the writer holds one of its pages in flight: free_request returns only after that
    write landed and its slot went back, so the store holds nothing of the request when it returns."""
    cache, store, gate = stalled
    for i in range(3):  # 2 in the LRU, page 0 queued and taken by the writer (blocked in flight)
        cache.put("a", i, page("a", i))
    end = time.monotonic() + 30
    while cache._busy is None and time.monotonic() < end:
        time.sleep(0.005)
    assert cache._busy == ("a", 0)
    freed: list[int] = []
    t = threading.Thread(target=lambda: freed.append(cache.free_request("a")), daemon=True)
    t.start()
    t.join(timeout=0.2)
    assert t.is_alive() and not freed  # still waiting on the write in flight
    gate.set()
    t.join(timeout=30)
    assert freed == [3] and store.used_slots == 0 and cache.queued_writes == 0
    assert cache.settle()
    assert store.used_slots == 0
    cache.check()


def test_try_put_declines_instead_of_waiting_on_a_full_queue(stalled) -> None:
    """The decode thread's seals in shrink mode use `try_put`: at the queue's bound it returns False at once and
    changes nothing (the page stays in the mirror and is offered again), never a back-pressure wait."""
    cache, store, gate = stalled
    for i in range(4):  # 2 in the LRU, the write queue at its bound of 2
        assert cache.try_put("a", i, page("a", i))
    assert cache.queued_writes == cache.write_queue_pages
    assert not cache.try_put("a", 4, page("a", 4))
    assert not cache.resident("a", 4) and cache.counters.write_waits == 0 and cache.counters.decode_disk_waits == 0
    gate.set()
    assert cache.settle()
    assert cache.try_put("a", 4, page("a", 4)) and bytes(cache.get("a", 4)) == page("a", 4)
    cache.check()
