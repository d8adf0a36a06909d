"""The disk tier wired under the engine (`TieredEngine`), in-process on CPU.

- Same steps with the tier on (a host cache smaller than the working set, read-ahead threads running) and off:
  after every recall the device reserve, the lookup table and the resident tables are byte-identical, and the
  tier really carried the pages (bytes written behind and read back > 0, misses > 0).
- A page corrupted on disk: the recall publishes the other request's pages, frees the corrupt request's blocks
  and raises a `CorruptPageError` naming that request and page; a second recall of it fails the same way.
- Disk full at write-behind: counted, the pages stay in DRAM, every recall still returns the exact bytes, and
  once space returns (a finish) the pinned pages are written.
- Finish returns every disk slot; with the tier off `build_engine` is the plain engine.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashmemory.env import DiskTierConfig
from flashmemory.offload import (
    Admission,
    AppendRound,
    BatchSync,
    EngineConfig,
    OffloadEngine,
    OffloadLayout,
    RecallRequest,
    RowSync,
    check_invariants,
)
from flashmemory.offload.disk import CorruptPageError, FaultyFileOps, HostPageCache, PageStore, disk_page_bytes
from flashmemory.offload.tiered_mirror import TieredEngine, build_engine, corrupt_page_in

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
CFG = EngineConfig(max_rows=4, max_chunks=128, recall_blocks=12, decode_pages=2, max_resident_pages=4)
torch.set_num_threads(1)


def chunks(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.randint(0, 256, (LAYOUT.n_layers, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = torch.randint(0, 256, (LAYOUT.n_layers, n, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g)
    return kv, ix


def tiered(tmp_path, cache_pages: int, ops: FaultyFileOps | None = None, readers: int = 2) -> TieredEngine:
    pb = disk_page_bytes(LAYOUT)
    store = PageStore(str(tmp_path), 64 * (pb + 8192), pb, ops=ops)
    return TieredEngine(LAYOUT, CFG, HostPageCache(store, cache_pages * pb, readers=readers))


def same_device_state(a: OffloadEngine, b: OffloadEngine) -> None:
    assert torch.equal(a.reserve.kv, b.reserve.kv), "reserve KV differs with the tier on"
    assert torch.equal(a.reserve.index, b.reserve.index), "reserve Path-I index-K differs with the tier on"
    assert torch.equal(a.lut.table, b.lut.table), "lookup table differs with the tier on"
    assert torch.equal(a.res_pages, b.res_pages) and torch.equal(a.res_count, b.res_count)


def admit_step(engines, specs, g) -> None:
    """specs: [(row, rid, n_chunks)], admitted in one sync_batch on every engine (same bytes)."""
    syncs = []
    for row, rid, n in specs:
        kv, ix = chunks(n, g)
        syncs.append(RowSync(row, Admission(row, rid, n, kv, ix, warm_pages=2)))
    for e in engines:
        e.sync_batch(BatchSync(rows=tuple(syncs)))


def decode_step(engines, rows, g) -> None:
    kv, ix = chunks(len(rows), g)
    for e in engines:
        e.sync_batch(BatchSync(appends=(AppendRound(tuple(rows), kv, ix),)))


def recall(engines, picks: dict[int, list[int]]) -> None:
    for e in engines:
        snap = e.snapshot_rows()
        reqs = [RecallRequest(r, snap[r][0], tuple(p), tuple(float(x) for x in p)) for r, p in picks.items()]
        e.recaller.recall(reqs)


def test_tier_on_equals_tier_off_with_a_cache_smaller_than_the_working_set(tmp_path):
    plain, tier = OffloadEngine(LAYOUT, CFG), tiered(tmp_path, cache_pages=3)
    engines = (plain, tier)
    g, rng = torch.Generator().manual_seed(1), random.Random(1)
    try:
        admit_step(engines, [(0, "a", 30), (1, "b", 21), (2, "c", 9)], g)
        for step in range(40):
            decode_step(engines, [0, 1, 2], g)
            if step % 4 == 3:  # a Level-1 cycle: random page picks over each history
                picks = {r: rng.sample(range(LAYOUT.pages_for(plain.n_chunks(r))), 3) for r in (0, 1, 2)}
                recall(engines, picks)
                same_device_state(plain, tier)
            if step == 20:  # a finish and a new request in its row mid-run
                for e in engines:
                    e.sync_batch(BatchSync(finished=(1,)))
                admit_step(engines, [(1, "d", 26)], g)
                same_device_state(plain, tier)
            assert not check_invariants(tier)
            tier.tier.check()
        st = tier.tier_stats()
        print(st)
        held = sum(LAYOUT.pages_for(tier.n_chunks(r)) for r in (0, 1, 2))
        assert held > tier.tier.capacity_pages, "the working set must not fit in the host cache"
        assert st["disk_bytes_written"] > 0 and st["disk_bytes_read"] > 0 and st["disk_cache_misses"] > 0
        assert st["disk_cache_hits"] > 0 and 0 < st["disk_cache_hit_rate"] < 1
        assert st["disk_write_errors"] == 0 and st["disk_corrupt_pages"] == 0
    finally:
        tier.close()


def test_a_corrupt_page_fails_its_request_only(tmp_path):
    ops = FaultyFileOps()
    eng = tiered(tmp_path, cache_pages=1, ops=ops)
    plain = OffloadEngine(LAYOUT, CFG)
    g = torch.Generator().manual_seed(2)
    try:
        admit_step((eng, plain), [(0, "req-A", 20), (1, "req-B", 20)], g)
        ops.plan.corrupt = 1000  # every write while A's pages are sealed (and written behind) is damaged
        eng.seal(skip={1})
        assert eng.tier.settle()  # written behind by the writer thread
        ops.plan.corrupt = 0
        eng.seal()  # B's pages push A's last one out: all of A's sealed pages are on disk, bad
        assert eng.tier.settle()
        with pytest.raises(CorruptPageError) as err:
            recall((eng,), {0: [0, 1], 1: [0, 1]})
        assert err.value.rid == "req-A" and err.value.page in (0, 1)
        assert "req-A" in str(err.value) and f"page {err.value.page}" in str(err.value)
        recall((plain,), {1: [0, 1]})
        cells = eng.cells(torch.tensor([0, 1]), torch.arange(8).repeat(2, 1))
        assert (cells[0] < 0).all(), "a page of the corrupt request was published"
        want = plain.cells(torch.tensor([1]), torch.arange(8).unsqueeze(0))[0]
        assert (cells[1] >= 0).all() and (want >= 0).all(), "the other request's pages were not published"
        pc = LAYOUT.page_chunks
        for p in (0, 1):  # same bytes, whatever block each engine gave the page
            a, b = int(cells[1][p * pc]) // pc, int(want[p * pc]) // pc
            assert torch.equal(eng.reserve.kv[:, a], plain.reserve.kv[:, b]), f"page {p} of req-B differs"
            assert torch.equal(eng.reserve.index[:, a], plain.reserve.index[:, b])
        assert not check_invariants(eng) and not eng.inflight
        with pytest.raises(CorruptPageError):  # the next cycle of the same request fails again, no wrong bytes
            recall((eng,), {0: [1]})
        assert eng.tier_stats()["disk_corrupt_pages"] >= 1
        # what the sglang adapter looks for in the Level-1 worker's error: the tier's error, naming the request
        try:
            try:
                recall((eng,), {0: [0]})
            except CorruptPageError as e:
                raise RuntimeError("Level-1 worker failed") from e
        except RuntimeError as outer:
            assert corrupt_page_in(outer).rid == "req-A"
        assert corrupt_page_in(RuntimeError("x")) is None
        eng.sync_batch(BatchSync(finished=(0, 1)))
        assert eng.tier.store.used_slots == 0 and not eng.tier.live_pages()
    finally:
        eng.close()


def test_disk_full_keeps_pages_in_dram_and_loses_nothing(tmp_path):
    ops = FaultyFileOps()
    eng, plain = tiered(tmp_path, cache_pages=2, ops=ops), OffloadEngine(LAYOUT, CFG)
    g = torch.Generator().manual_seed(3)
    try:
        admit_step((eng, plain), [(0, "x", 28), (1, "y", 24), (2, "z", 8)], g)
        ops.plan.full = True
        eng.sync_batch(BatchSync())  # seals 6 + 5 + 1 pages into a 2-page cache: write-behind hits ENOSPC
        plain.sync_batch(BatchSync())
        assert eng.tier.settle()
        st = eng.tier_stats()
        assert st["disk_write_errors"] > 0 and st["disk_pages_in_dram_pinned"] > 0
        recall((eng, plain), {0: [0, 1, 2, 3], 1: [0, 1, 2]})
        same_device_state(plain, eng)  # nothing lost: every page came back exact from DRAM
        eng.tier.check()
        ops.plan.full = False
        for e in (eng, plain):
            e.sync_batch(BatchSync(finished=(2,)))  # a finish: space returns, pinned pages are written now
        assert eng.tier.settle()  # ... by the writer thread
        assert eng.tier.pinned_pages == 0 and eng.tier_stats()["disk_bytes_written"] > 0
        eng.tier.drop_clean()  # a cold cache: the next recall reads from disk
        recall((eng, plain), {0: [4, 5], 1: [3, 4]})
        same_device_state(plain, eng)
        assert eng.tier_stats()["disk_bytes_read"] > 0
    finally:
        eng.close()


def test_build_engine_is_the_plain_engine_with_the_tier_off(tmp_path, caplog):
    assert type(build_engine(LAYOUT, CFG, "cpu", DiskTierConfig())) is OffloadEngine
    caplog.set_level("INFO", logger="flashmemory.offload.disk")
    eng = build_engine(LAYOUT, CFG, "cpu", DiskTierConfig(dir=str(tmp_path), disk_gb=0.001, host_cache_gb=0.0001))
    try:
        assert isinstance(eng, TieredEngine) and eng.recaller.source is eng
        assert any("disk tier (rank 0)" in r.getMessage() and str(tmp_path) in r.getMessage() for r in caplog.records)
    finally:
        eng.close()
    assert not list(tmp_path.iterdir()), "the store file outlived close()"


def test_an_unwaited_copy_through_the_tier_leaves_no_host_wait(tmp_path, monkeypatch):
    """The decode thread's copies (an admission's warm start, a lockstep cycle: `copy(wait=False)`) through the tier
    stage into fresh pinned memory and mark the copy with an event: no synchronize on the calling thread; the
    publish's stream waits for it. The bytes are the tier-off engine's."""
    from tests.support.cuda_standin import count_blocking, on_thread, reset

    count_blocking(monkeypatch)  # reserve on the stand-in device; the rows below in host memory
    plain, tier = OffloadEngine(LAYOUT, CFG), tiered(tmp_path, cache_pages=3)
    g = torch.Generator().manual_seed(3)
    try:
        admit_step((plain, tier), [(0, "a", 30), (1, "b", 26)], g)
        for _ in range(3):
            decode_step((plain, tier), [0, 1], g)  # seals complete pages into the tier
        tier.tier.drop_clean()
        reset()
        for e in (plain, tier):
            snap = e.snapshot_rows()
            e.recaller.recall([RecallRequest(r, snap[r][0], (0, 1, 2), (3.0, 2.0, 1.0)) for r in (0, 1)], wait=False)
        waits = [b for b in on_thread() if b.kind == "sync"]
        assert not waits, [b.where for b in waits]
        assert tier.tier_stats()["disk_bytes_read"] > 0  # the tier really carried them
        assert torch.equal(plain.reserve.kv, tier.reserve.kv) and torch.equal(plain.lut.table, tier.lut.table)
        assert not check_invariants(tier)
    finally:
        tier.close()
