"""The core's verbs for callers outside it (`offload.access.CoreAccess`): what they write and read, in the core's
own addresses (mirror chunks, reserve cells, engine rows)."""

from __future__ import annotations

import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, check_invariants
from flashmemory.offload.sync import Admission, AppendRound, BatchSync, RowSync

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
CFG = EngineConfig(max_rows=4, max_chunks=64, recall_blocks=10, decode_pages=2, max_resident_pages=4)


def chunks(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 256, (3, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = torch.randint(0, 256, (3, n, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g)
    return kv, ix


def mchunks(eng: OffloadEngine, row: int, n: int) -> torch.Tensor:
    pc = LAYOUT.page_chunks
    mp = eng.rows[row].mpages
    return torch.tensor([mp[j // pc] * pc + j % pc for j in range(n)], dtype=torch.int64)


def test_sync_result_carries_the_batchs_resident_pages() -> None:
    eng = OffloadEngine(LAYOUT, CFG)
    res = eng.sync_batch(
        BatchSync(
            rows=(
                RowSync(0, Admission(0, "a", 13, *chunks(13, 1), warm_pages=4)),
                RowSync(2, Admission(2, "b", 6, *chunks(6, 2))),
            ),
            appends=(AppendRound((0, 2), *chunks(2, 3)),),
            batch=(2, -1, 0),
        )
    )
    want = eng.resident_pages(torch.tensor([2, -1, 0]))
    assert res.resident is not None and torch.equal(res.resident, want)
    assert (res.resident[1] == -1).all() and (res.resident[2] >= 0).sum() > 1  # warm start made pages resident
    assert eng.free_mirror_pages() < eng.cfg.max_rows * eng.max_pages
    assert eng.sync_batch(BatchSync(finished=(0, 2))).resident is None
    assert eng.free_mirror_pages() == eng.cfg.max_rows * eng.max_pages


def test_store_chunks_writes_the_mirror_and_only_resident_cells() -> None:
    eng = OffloadEngine(LAYOUT, CFG)
    eng.admit(0, *chunks(13, 1), rid="a")
    eng.open_tail_page(0)  # page 3 (chunk 12) resident, pages 0-2 only in the mirror
    m = mchunks(eng, 0, 13)
    kv, ix = chunks(13, 9)
    eng.store_chunks(m, [0, 1, 2], kv, [ix[0], ix[1], ix[2]])
    cells = eng.cell_table()[m].long()
    pc = LAYOUT.page_chunks
    assert (cells[12] >= 0) and (cells[:12] < 0).all()
    got = LAYOUT.kv.read_chunks(eng.storage().reserve_kv, cells[12:] // pc, cells[12:] % pc)
    assert torch.equal(got, kv[:, 12:])
    mirror = LAYOUT.kv.read_chunks(eng.storage().mirror_kv, m // pc, m % pc)
    assert torch.equal(mirror, kv)
    assert torch.equal(eng.target.chunks(1, m), ix[1])  # target layer 1's index-K
    assert not check_invariants(eng)


def test_store_chunks_of_some_layers_leaves_the_others() -> None:
    eng = OffloadEngine(LAYOUT, CFG)
    kv0, _ = chunks(5, 1)
    eng.admit(0, kv0, None, rid="a")
    m = mchunks(eng, 0, 5)
    kv, _ = chunks(5, 4)
    eng.store_chunks(m, [2], kv[2:3])
    pc = LAYOUT.page_chunks
    mirror = LAYOUT.kv.read_chunks(eng.storage().mirror_kv, m // pc, m % pc)
    assert torch.equal(mirror[2], kv[2]) and torch.equal(mirror[:2], kv0[:2])


def test_settle_cells_moves_cell_bytes_to_the_mirror_and_the_current_cell() -> None:
    """A caller's kernel wrote a chunk into the cell it was handed (here the sink cell), while the chunk is
    resident in another cell now: the bytes reach the mirror and that cell."""
    eng = OffloadEngine(LAYOUT, CFG)
    eng.admit(0, *chunks(6, 1), rid="a")
    now = eng.decode_append([0], None, None)  # chunk 6's cell; its bytes not written yet
    m = mchunks(eng, 0, 7)[6:]
    slots, pc = eng.slots(), LAYOUT.page_chunks
    handed = torch.tensor([slots.sink_cell])
    kv, _ = chunks(1, 5)
    LAYOUT.kv.write_chunks(eng.storage().reserve_kv, handed // pc, handed % pc, kv)  # the caller's kernel
    eng.settle_cells(m, handed)
    assert torch.equal(LAYOUT.kv.read_chunks(eng.storage().mirror_kv, m // pc, m % pc), kv)
    assert torch.equal(LAYOUT.kv.read_chunks(eng.storage().reserve_kv, now // pc, now % pc), kv)
    assert slots.sink_cell == slots.sink_block * pc and slots.n_blocks > slots.sink_block


def test_occupancy_counts_blocks_and_mirror_bytes() -> None:
    eng = OffloadEngine(LAYOUT, CFG)
    empty = eng.occupancy()
    eng.admit(0, *chunks(13, 1), rid="a")
    eng.recaller.warm_start(0, 3)
    now = eng.occupancy()
    assert empty["free_reserve_blocks"] == empty["reserve_blocks"] == CFG.recall_blocks
    assert now["free_reserve_blocks"] == eng.free_blocks() < CFG.recall_blocks
    assert now["host_mirror_slots_in_use"] == 4 and now["host_mirror_bytes_in_use"] == 4 * eng.mirror.page_bytes
