"""`QueuedPages`: queued requests' landed pages under a DRAM cap, on a bare `SparseMirror` and tier.

Past the cap the queue's tail is parked (never a request admitted next), a parked request admitted next is held
back until its pages are written back byte-exact at their addresses, a request leaving the queue while parked
frees its tier copy, and `SparseMirror.park` never returns an OS page shared with a page that is not parked."""

from __future__ import annotations

import threading

import pytest
import torch

from flashmemory.offload import OffloadLayout
from flashmemory.offload.disk import FaultyFileOps, HostPageCache, PageStore, disk_page_bytes
from flashmemory.offload.disk.queued import LANDED, PARKED, READY, QueuedPages
from flashmemory.offload.disk.sparse_mirror import OS_PAGE, SparseMirror, resident_bytes

LAYOUT = OffloadLayout(n_layers=2, target_layers=(1,))  # 37,376-B KV pages: not a multiple of 4 KiB
PAGES = {"a": [3, 4, 5], "b": [10, 11], "c": [20, 21, 22]}


@pytest.fixture
def queued(tmp_path):
    m = SparseMirror(LAYOUT, 32)
    pb = disk_page_bytes(LAYOUT)
    store = PageStore(str(tmp_path), 64 * pb, pb)
    tier = HostPageCache(store, pb, worker=False)  # one page in DRAM: the rest is written to the store
    truth = {}
    g = torch.Generator().manual_seed(0)
    for pages in PAGES.values():
        for p in pages:  # landed as the transfer engine writes: at the page's address, the page still free
            truth[p] = torch.randint(1, 256, (LAYOUT.n_layers, LAYOUT.kv_page_bytes), dtype=torch.uint8, generator=g)
            m.kv[:, p] = truth[p]
    q = QueuedPages(m, tier, LAYOUT, 2 * pb, threading.RLock(), worker=False)
    yield q, m, tier, truth
    tier.close()
    store.close()


def order(*rids: str, known: set[str] = frozenset()) -> list[tuple[str, list[int] | None]]:
    return [(r, None if r in known else PAGES[r]) for r in rids]


def test_over_the_cap_the_tail_is_parked_and_comes_back_exact(queued):
    q, m, tier, truth = queued
    before = resident_bytes(m.kv)
    assert q.update(order("a", "b", "c"), n_next=1) == set()
    assert q.state("a") == LANDED and q.state("b") == PARKED and q.state("c") == PARKED  # 8 pages, cap 2
    assert q.held_bytes() == 3 * q.page_bytes and m.parked == {10, 11, 20, 21, 22}
    assert resident_bytes(m.kv) < before and tier.counters.disk_bytes_written > 0
    assert q.refusal("b") and "not back in host DRAM" in q.refusal("b")
    assert q.update(order("b", "c", known={"b", "c"}), n_next=1) == {"b"}  # a admitted; b restored (inline)
    assert q.state("b") == READY and q.refusal("b") is None and 10 not in m.parked
    for p in PAGES["b"]:
        assert torch.equal(m.kv[:, p], truth[p]), p
    assert tier.counters.disk_bytes_read > 0 and q.counters.restored_pages == 2
    assert "b" not in tier.live_pages()  # its tier copy is freed: the engine seals it again once it runs
    assert q.update(order("b", "c", known={"b", "c"}), n_next=1) == set()


def test_a_parked_request_leaving_the_queue_frees_its_tier_copy(queued):
    q, m, tier, _ = queued
    q.update(order("a", "b", "c"), n_next=1)
    assert q.state("c") == PARKED and "c" in tier.live_pages()
    q.update(order("a", "b", known={"a", "b"}), n_next=1)  # c aborted while parked
    assert q.state("c") is None and "c" not in tier.live_pages() and not ({20, 21, 22} & m.parked)
    q.update([], n_next=1)
    assert q.state("a") is None and q.state("b") is None and tier.live_pages() == {}


def test_park_keeps_an_os_page_shared_with_a_page_that_is_not_parked() -> None:
    m = SparseMirror(LAYOUT, 8)
    for p in range(3):
        m.kv[:, p] = p + 1
    with pytest.raises(ValueError, match="claimed"):
        m.park(m.claim([5]))
    m.park([1])  # its neighbours 0 and 2 are free and hold bytes (queued, not parked): the shared OS pages stay
    assert torch.all(m.kv[:, 0] == 1) and torch.all(m.kv[:, 2] == 3)
    assert m.dropped_bytes >= LAYOUT.n_layers * (LAYOUT.kv_page_bytes - 2 * OS_PAGE)
    m.unpark(1, torch.full((2, LAYOUT.kv_page_bytes), 7, dtype=torch.uint8), m.index[:, 1].clone())
    assert torch.all(m.kv[:, 1] == 7) and not m.parked


def test_wait_room_leaves_half_the_write_queue_to_the_decode_thread(tmp_path):
    pb = disk_page_bytes(LAYOUT)
    ops = FaultyFileOps()
    store = PageStore(str(tmp_path), 64 * pb, pb, ops=ops)
    ops.plan.write_gate = threading.Event()  # a stalled drive from here on: queued writes stay queued
    tier = HostPageCache(store, pb, write_queue_pages=4)
    try:
        page = bytes(pb)
        tier.put("a", 0, page)
        assert tier.wait_room(timeout=1.0)
        for i in range(1, 5):  # 3 pages queued behind the stalled one
            tier.put("a", i, page)
        assert not tier.wait_room(timeout=0.2)  # over half of 4: a background producer waits here
        ops.plan.write_gate.set()
        assert tier.wait_room(timeout=30.0) and tier.settle()
    finally:
        ops.plan.write_gate.set()
        tier.close()
        store.close()
