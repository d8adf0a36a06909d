"""The host mirror as a landing window under the disk tier, in-process on CPU.

- The steps of the tier-on vs tier-off test (admissions, decode steps, Level-1 cycles, a finish and a reuse of
  its row) with a window of few slots: after every recall the lookup table and the resident tables are equal to
  the plain engine's, every byte they map in the reserve is equal, and every recalled complete page is equal
  block for block; the window's peak slots in use stay below the pages in use (the tier lowers host DRAM).
- An admission lands only its tail page in the window; a seal releases the slots of sealed pages; a finish
  returns every slot, page id and disk slot.
- Out of slots is an OffloadCapacityError naming the knob, and the failed admission leaves nothing behind.
- `build_engine` sizes the window from SGLANG_PATHP_HOST_MIRROR_GB (floor: max_rows x 3 slots), logs it, and
  keeps a full mirror when asked (shrink mode).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from flashmemory.env import DiskTierConfig
from flashmemory.offload import BatchSync, OffloadCapacityError, OffloadEngine, check_invariants
from flashmemory.offload.disk import HostPageCache, PageStore, disk_page_bytes
from flashmemory.offload.disk.sparse_mirror import SparseMirror
from flashmemory.offload.tiered_mirror import TieredEngine, build_engine, window_slots

# The tier-on vs tier-off test's engine shape and steps: the window runs the same admissions, appends and recalls.
from tests.offload.test_tiered_mirror import CFG, LAYOUT, admit_step, chunks, decode_step, recall  # noqa: E402

PC = LAYOUT.page_chunks


def windowed(tmp_path, slots: int, cache_pages: int = 3) -> TieredEngine:
    pb = disk_page_bytes(LAYOUT)
    store = PageStore(str(tmp_path), 256 * (pb + 8192), pb)
    return TieredEngine(LAYOUT, replace(CFG, mirror_slots=slots), HostPageCache(store, cache_pages * pb, readers=2))


def same_readable_state(a: OffloadEngine, b: OffloadEngine) -> None:
    """Same lookup table and resident tables, the same bytes at every mapped reserve cell, and every recalled
    complete page equal block for block (unmapped cells of a partial page may hold different stale bytes)."""
    assert torch.equal(a.lut.table, b.lut.table), "lookup table differs with the window on"
    assert torch.equal(a.res_pages, b.res_pages) and torch.equal(a.res_count, b.res_count)
    cells = a.lut.table[:-1].long()
    cells = cells[cells >= 0]
    for fmt, ra, rb in ((LAYOUT.kv, a.reserve.kv, b.reserve.kv), (LAYOUT.index, a.reserve.index, b.reserve.index)):
        assert torch.equal(fmt.read_chunks(ra, cells // PC, cells % PC), fmt.read_chunks(rb, cells // PC, cells % PC))
    for r, st in enumerate(a.rows):
        if st is None:
            continue
        for p, blk in st.recall.items():
            if p < (st.n_chunks - 1) // PC:
                assert torch.equal(a.reserve.kv[:, blk], b.reserve.kv[:, b.rows[r].recall[p]]), (r, p)
                assert torch.equal(a.reserve.index[:, blk], b.reserve.index[:, b.rows[r].recall[p]]), (r, p)


def pages_in_use(e: OffloadEngine) -> int:
    return sum(len(st.mpages) for st in e.rows if st is not None)


def test_window_equals_the_plain_engine_with_few_slots(tmp_path):
    slots = 12  # = max_rows x (1 landed + 2): the floor; the mirror has 128 page ids
    plain, win = OffloadEngine(LAYOUT, CFG), windowed(tmp_path, slots)
    engines = (plain, win)
    g, rng = torch.Generator().manual_seed(1), random.Random(1)
    assert win.mirror.kv.shape[1] == slots and win.mirror.n_pages == 128
    peak_pages = 0
    try:
        admit_step(engines, [(0, "a", 30), (1, "b", 21), (2, "c", 9)], g)
        assert win.mirror.slots_in_use == 3, "an admission lands more than its tail page in the window"
        same_readable_state(plain, win)  # the warm start read the landed pages from the tier
        for step in range(40):
            decode_step(engines, [0, 1, 2], g)
            peak_pages = max(peak_pages, pages_in_use(win))
            if step % 4 == 3:
                picks = {r: rng.sample(range(LAYOUT.pages_for(plain.n_chunks(r))), 3) for r in (0, 1, 2)}
                recall(engines, picks)
                same_readable_state(plain, win)
            if step == 20:
                for e in engines:
                    e.sync_batch(BatchSync(finished=(1,)))
                admit_step(engines, [(1, "d", 26)], g)
                same_readable_state(plain, win)
            assert not check_invariants(win)  # resident bytes equal the mirror's, or the tier's once released
            win.tier.check()
            # after a step's seal every row holds at most its tail page and the page its append opened
            assert win.mirror.slots_in_use <= 2 * 3
        m = win.mirror
        print(
            f"window: peak slots in use {m.peak_slots} of {m.n_slots}, peak pages in use {peak_pages}, "
            f"mirror {m.physical_bytes} B vs {m.n_pages * m.page_bytes} B full size; {win.tier_stats()}"
        )
        assert m.peak_slots < peak_pages and m.peak_slots <= slots
        assert peak_pages > win.tier.capacity_pages
        st = win.tier_stats()
        assert st["disk_bytes_written"] > 0 and st["disk_bytes_read"] > 0 and st["disk_write_errors"] == 0
        for e in engines:
            e.sync_batch(BatchSync(finished=(0, 1, 2)))
        assert m.slots_in_use == 0 and m.free_pages == m.n_pages, "slots or page ids leaked at finish"
        assert win.tier.store.used_slots == 0 and not win.tier.live_pages()
    finally:
        win.close()


def test_seal_releases_sealed_pages_and_a_released_page_is_never_read(tmp_path):
    win = windowed(tmp_path, 12, cache_pages=2)
    g = torch.Generator().manual_seed(5)
    try:
        admit_step((win,), [(0, "x", 6)], g)  # 2 pages: page 0 lands in the tier, page 1 in the window
        st = win.rows[0]
        assert int(win.mirror.slot_of[st.mpages[0]]) < 0 <= int(win.mirror.slot_of[st.mpages[1]])
        for _ in range(7):  # chunks 6..12: pages 1 and 2 fill, page 3 opens
            decode_step((win,), [0], g)
        # each step seals the pages before the newest chunk's: page 1 went at the step appending chunk 9
        assert [int(win.mirror.slot_of[mp]) >= 0 for mp in st.mpages] == [False, False, True, True]
        win.sync_batch(BatchSync())  # the next step's seal releases pages 1 and 2
        assert [int(win.mirror.slot_of[mp]) >= 0 for mp in st.mpages] == [False, False, False, True]
        assert win.mirror.slots_in_use == 1 and win.sealed[0][1] == 3
        recall((win,), {0: [0, 1, 2]})  # released pages come back through the tier, exact
        assert not check_invariants(win)
        assert (win.cells(torch.tensor([0]), torch.arange(12).unsqueeze(0)) >= 0).all(), "a page was not recalled"
    finally:
        win.close()


def test_out_of_slots_names_the_knob_and_leaves_nothing_behind(tmp_path):
    win = windowed(tmp_path, 2)
    g = torch.Generator().manual_seed(7)
    try:
        admit_step((win,), [(0, "p", 9), (1, "q", 5)], g)
        assert win.mirror.slots_in_use == 2
        free_ids = win.mirror.free_pages
        with pytest.raises(OffloadCapacityError, match="raise SGLANG_PATHP_HOST_MIRROR_GB") as e:
            admit_step((win,), [(2, "r", 10)], g)
        assert "\n" not in str(e.value)
        assert win.rows[2] is None and win.mirror.free_pages == free_ids and "r" not in win.tier.live_pages()
        assert not check_invariants(win)
    finally:
        win.close()


def test_build_engine_sizes_and_logs_the_window(tmp_path, caplog):
    pb = disk_page_bytes(LAYOUT)
    disk = DiskTierConfig(dir=str(tmp_path), disk_gb=0.001, host_cache_gb=0.0001, host_mirror_gb=(20 * pb + 0.5) / 1e9)
    assert window_slots(disk, LAYOUT, CFG) == 20
    assert window_slots(replace(disk, host_mirror_gb=pb / 1e9), LAYOUT, CFG) == 12  # the floor: 4 rows x 3
    assert window_slots(replace(disk, host_mirror_gb=1.0), LAYOUT, CFG) is None  # holds every page anyway
    assert window_slots(replace(disk, host_mirror_gb=0.0), LAYOUT, CFG) is None  # unset: full size
    caplog.set_level("INFO", logger="flashmemory.offload.disk")
    eng = build_engine(LAYOUT, CFG, "cpu", disk)
    try:
        assert isinstance(eng, TieredEngine) and eng.mirror.n_slots == 20 and eng.cfg.mirror_slots == 20
        assert any("host mirror landing window 20 of 128 page slots" in r.getMessage() for r in caplog.records)
    finally:
        eng.close()
    caplog.clear()
    eng = build_engine(LAYOUT, CFG, "cpu", disk, full_mirror=True)  # shrink mode: PD lands by pool page id
    try:
        assert isinstance(eng.mirror, SparseMirror) and eng.mirror.n_slots == 128  # DRAM only where it holds bytes
        assert any("caps the landed pages of requests waiting to run" in r.getMessage() for r in caplog.records)
        assert eng.queued is not None and eng.queued.cap_bytes == disk.host_mirror_bytes
        assert any("host mirror full size (128 pages" in r.getMessage() for r in caplog.records)
    finally:
        eng.close()
    assert type(build_engine(LAYOUT, CFG, "cpu", DiskTierConfig(host_mirror_gb=1.0))) is OffloadEngine


def test_serving_gauges_report_the_window(tmp_path):
    """/metrics: the mirror's physical bytes are slots x page bytes, and the slots in use return to 0 at finish."""
    from types import SimpleNamespace

    from flashmemory.sglang.metrics.prometheus import SERVING_METRICS, serving_gauges

    assert {"host_mirror_bytes", "host_mirror_slots_in_use"} <= set(SERVING_METRICS)
    win = windowed(tmp_path, 12)
    g = torch.Generator().manual_seed(9)
    try:
        admit_step((win,), [(0, "u", 17), (1, "v", 3)], g)
        gauges = serving_gauges(SimpleNamespace(engine=win, rows={"u": 0, "v": 1}))
        pb = disk_page_bytes(LAYOUT)
        assert gauges["host_mirror_bytes"] == 12 * pb < 128 * pb
        assert gauges["host_mirror_slots_in_use"] == 2 and gauges["host_mirror_bytes_in_use"] == 2 * pb
        win.sync_batch(BatchSync(finished=(0, 1)))
        gauges = serving_gauges(SimpleNamespace(engine=win, rows={}))
        assert gauges["host_mirror_slots_in_use"] == 0 == gauges["host_mirror_bytes_in_use"]
    finally:
        win.close()
    plain = OffloadEngine(LAYOUT, CFG)
    plain.admit(0, *chunks(9, g))
    gauges = serving_gauges(SimpleNamespace(engine=plain, rows={"a": 0}))  # full size: slots = pages in use
    assert gauges["host_mirror_slots_in_use"] == 3 and gauges["host_mirror_bytes"] == 128 * disk_page_bytes(LAYOUT)
