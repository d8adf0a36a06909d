"""The disk tier behind the sglang adapter, on a fake c4 pool, no server: the adapter builds a
`TieredEngine` when SGLANG_PATHP_DISK_DIR is set (the plain engine otherwise), its stats carry the disk counters
/metrics exports, and a page that fails verification in a Level-1 recall becomes the guard's `RequestFailure`
naming that request and page (the guard then fails that request alone)."""

from __future__ import annotations

import pytest
import torch

from flashmemory.env import DiskTierConfig
from flashmemory.offload import OffloadEngine, RecallRequest
from flashmemory.offload.disk import CorruptPageError, FaultyFileOps
from flashmemory.offload.tiered_mirror import TIER_STATS, TieredEngine
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.guard import RequestFailure
from flashmemory.sglang.metrics.prometheus import DISK_KEYS, METRICS, MONITOR_KEYS
from tests.sglang.decode.test_copy_adapter import PAGE, env, fake_pool

pytestmark = pytest.mark.sglang
TABLE = torch.tensor([[3, 4, 8, 1], [5, 6, 7, 0]])  # two requests of 4 pool pages each


def tiered_adapter(tmp_path):
    # One disk page here: 3 c4 layers x 37,440 B + 2 Path-I layers x 8,448 B = 129,216 B; the cache holds one.
    disk = DiskTierConfig(dir=str(tmp_path), disk_gb=0.01, host_cache_gb=0.00013)
    return build(fake_pool(1), env("", disk=disk))


def test_the_adapter_builds_the_tier_only_when_asked(tmp_path):
    plain = build(fake_pool(1), env(""))
    assert type(plain.engine) is OffloadEngine and plain.tier is None
    assert not any(k.startswith("disk_") for k in plain.stats())
    plain.close()
    ad = tiered_adapter(tmp_path)
    try:
        assert isinstance(ad.engine, TieredEngine) and ad.tier is ad.engine
        stats = ad.stats()
        assert set(TIER_STATS) == set(DISK_KEYS) and set(stats) == set(METRICS) - set(MONITOR_KEYS)
    finally:
        ad.close()


def test_a_corrupt_disk_page_fails_its_request_in_level1(tmp_path):
    ad = tiered_adapter(tmp_path)
    try:
        s = torch.tensor([4 * PAGE - 3] * 2)
        ad.begin_step(["a", "b"], TABLE, s)  # admitted: nothing sealed yet; warm start: pages 2-3 resident
        row = ad.rows["a"]  # hold page 0 instead of page 2 (read from the mirror: not sealed yet)
        ad.engine.recaller.recall([RecallRequest(row, ad.engine.gen(row), (0,), (1.0,), budget=1)])
        assert ad.resident_pages(torch.tensor([row]))[0].tolist()[:2] == [0, 3]
        ops = FaultyFileOps()
        ad.tier.tier.store.ops = ops
        ops.plan.corrupt = 1000  # every page written behind from here on is damaged
        ad.begin_step(["a", "b"], TABLE, s + 1)  # seals pages 0-2 of each; all but the last go to disk
        assert ad.tier.tier.settle()  # the writer thread has written them behind
        assert ad.stats()["disk_bytes_written"] > 0
        ad.make_failure = RequestFailure  # what hooks.after_pool_init hands the adapter
        with pytest.raises(RequestFailure) as err:  # Level 1 keeps the newest 2 pages: page 2 comes from disk
            ad.level1({"positions": s})
        assert err.value.rid == "a" and "page 2" in err.value.reason and "corrupt" in err.value.reason
        assert isinstance(err.value.__cause__, CorruptPageError)
        assert ad.stats()["disk_corrupt_pages"] >= 1
        ad.begin_step([], TABLE[:0], s[:0])  # both leave: their slots return
        assert ad.tier.tier.store.used_slots == 0
    finally:
        ad.close()


def test_copy_mode_with_a_landing_window_serves_the_pool_bytes(tmp_path):
    """SGLANG_PATHP_HOST_MIRROR_GB in copy mode: the mirror holds DECODE_MAX_CONC x 3 = 6 slots for 12 pool pages;
    admission, per-layer stores, next-step settles, seals and Level-1 recalls (from the tier) keep every mapped
    reserve chunk equal to the pool's bytes, the same table as the host-only adapter, and return every slot."""
    from flashmemory.offload import check_invariants
    from flashmemory.sglang.decode.geometry import c4_counts, read_chunk_rows
    from flashmemory.sglang.decode.resident_topk import pool_locs
    from flashmemory.sglang.decode.tables import c4_page_table
    from tests.sglang.decode.test_copy_adapter import write_chunk

    pools = (fake_pool(1), fake_pool(1))
    disk = DiskTierConfig(dir=str(tmp_path), disk_gb=0.01, host_cache_gb=0.00013, host_mirror_gb=1e-6)
    ads = (build(pools[0], env("")), build(pools[1], env("", disk=disk)))
    win = ads[1].engine
    assert isinstance(win, TieredEngine) and win.mirror.n_slots == 6 < win.mirror.n_pages == 12
    pages = [5, 2, 9, 7, 3]
    r2t = torch.full((2, 5 * PAGE), -1, dtype=torch.int64)
    r2t[1] = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
    seq = 4 * PAGE - 12  # 253 chunks: 3 complete pages land in the tier
    lay = ads[0].layout
    try:
        for step in range(28):  # 7 chunks more: page 3 fills and is sealed, page 4 opens
            s = torch.tensor([seq + 1 + step])
            table = c4_page_table(r2t, torch.tensor([1]), s, PAGE)
            before, after = c4_counts(s)
            loc = pages[int(before) // 64] * 64 + int(before) % 64
            for pool, ad in zip(pools, ads):
                if after > before:
                    write_chunk(pool, loc, seed=step)
                ad.begin_step(["a"], table, s)
                if after > before:
                    for l in range(lay.n_layers):
                        ad.on_c4_store(l, torch.tensor([loc]))
                ad.level1({"positions": s - 1})
            assert torch.equal(ads[0].engine.lut.table, win.lut.table)
            n = win.n_chunks(0)
            locs = pool_locs(table, n)[0]
            cells = ads[1].cells_of(locs.view(1, -1))[0].long()
            ok = cells >= 0
            assert torch.equal(
                lay.kv.read_chunks(win.reserve.kv, cells[ok] // 64, cells[ok] % 64),
                read_chunk_rows(lay.kv, pools[1].c4_kv_pool.kv_buffer, locs[ok]),
            )
            assert check_invariants(win) == [] and win.mirror.slots_in_use <= 2
        assert win.n_chunks(0) == 260 and win.sealed[0][1] == 4 and win.tier.settle()
        assert win.tier_stats()["disk_bytes_written"] > 0
        assert win.mirror.peak_slots <= 2 < len(win.rows[0].mpages)
        for ad in ads:
            ad.begin_step([], table[:0], s[:0])
        assert win.mirror.slots_in_use == 0 and win.tier.store.used_slots == 0
    finally:
        for ad in ads:
            ad.close()
