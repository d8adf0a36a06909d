"""Caller-owned mirror pages (sglang's pool pages in shrink mode): claim, admit without bytes, add_pages,
cells-only decode appends, and the newest page is never evicted from under a decode write."""

import pytest
import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, RecallRequest, check_invariants, recall_now
from flashmemory.offload.mirror import HostMirror

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))


def rand(n, g):
    return (
        torch.randint(0, 256, (3, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g),
        torch.randint(0, 256, (3, n, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g),
    )


def test_claim_and_alloc_share_one_free_set():
    m = HostMirror(LAYOUT, 8, pin=False)
    assert m.claim([5, 2]) == [5, 2] and m.free_pages == 6
    assert m.alloc(3) == [0, 1, 3]  # skips the claimed 2
    with pytest.raises(RuntimeError, match=r"\[2\] are already owned"):
        m.claim([2])
    with pytest.raises(ValueError, match="twice"):
        m.claim([6, 6])
    with pytest.raises(IndexError, match="outside"):
        m.claim([8])
    m.free([2, 5])
    assert sorted(m.alloc(5)) == [2, 4, 5, 6, 7] and m.free_pages == 0
    m.free([0, 0])  # a double free does not create two free copies
    assert m.free_pages == 1


def test_admit_with_pages_already_holding_bytes():
    eng = OffloadEngine(
        LAYOUT,
        EngineConfig(max_rows=2, max_chunks=32, mirror_pages=16, recall_blocks=4, decode_pages=1, max_resident_pages=2),
        "cpu",
    )
    g = torch.Generator().manual_seed(0)
    kv, ix = rand(6, g)
    pages = [11, 4]
    m = torch.tensor([pages[j // 4] * 4 + j % 4 for j in range(6)])
    LAYOUT.kv.write_chunks(eng.mirror.kv, m // 4, m % 4, kv)  # "a PD transfer wrote these"
    with pytest.raises(ValueError, match="needs mpages"):
        eng.admit(0, None, None)
    with pytest.raises(ValueError, match="3 mirror pages given for 6 chunks"):
        eng.admit(0, None, None, mpages=[11, 4, 5], n_chunks=6)
    eng.admit(0, None, ix, mpages=pages, n_chunks=6)
    assert eng.rows[0].mpages == pages and eng.n_chunks(0) == 6
    assert torch.equal(LAYOUT.kv.read_chunks(eng.mirror.kv, m // 4, m % 4), kv)  # bytes left as they were
    assert torch.equal(eng.target.chunks(1, m), ix[1])  # index written as given
    eng.add_pages(0, [7])
    cells = eng.decode_append([0], None, None)
    cells = torch.cat([cells, eng.decode_append([0], None, None), eng.decode_append([0], None, None)])
    assert eng.rows[0].mpages == [11, 4, 7] and eng.n_chunks(0) == 9
    # cells only: published in the table, bytes left to the caller. Opening page 2's decode block retired page 1
    # (one decode page per row) to a recall block, so chunks 6 and 7 moved there.
    got = eng.lut.table[torch.tensor([4 * 4 + 2, 4 * 4 + 3, 7 * 4 + 0])].long()
    assert got[2] == cells[2] and (got >= 0).all() and (got != eng.reserve.sink_cell).all()
    assert eng.rows[0].recall == {1: int(got[0]) // 4} and cells[0] // 4 == eng.reserve.decode_block(0, 0)
    with pytest.raises(RuntimeError, match="already owned"):
        eng.add_pages(0, [4])
    eng.finish(0)
    assert eng.mirror.free_pages == 16


def test_newest_page_is_not_evicted_by_its_own_cycle():
    eng = OffloadEngine(
        LAYOUT, EngineConfig(max_rows=1, max_chunks=32, recall_blocks=4, decode_pages=1, max_resident_pages=1), "cpu"
    )
    g = torch.Generator().manual_seed(1)
    gen = eng.admit(0, *rand(10, g))  # pages 0, 1, 2 (page 2 holds the newest chunk)
    recall_now(eng, [RecallRequest(0, gen, (2,), (1.0,))])
    assert 2 in eng.rows[0].recall
    recall_now(eng, [RecallRequest(0, gen, (0,), (1.0,))])  # a selection without the newest page (no recency tail)
    assert 2 in eng.rows[0].recall and not check_invariants(eng)


def test_host_memory_check(tmp_path):
    from flashmemory.offload.mirror import OffloadCapacityError, check_host_memory

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       1000000 kB\nMemAvailable:   102400 kB\n")  # 100 MiB available
    check_host_memory(40 * 2**20, processes=2, meminfo=str(info))  # 80 MiB <= 90 MiB
    with pytest.raises(OffloadCapacityError, match=r"x 3 local rank\(s\) = 0.1 GiB.*0.1 GiB is available"):
        check_host_memory(40 * 2**20, processes=3, meminfo=str(info))
    check_host_memory(10**15, meminfo=str(tmp_path / "missing"))  # unknown host: no check
