"""`OffloadEngine.sync_batch` (one call per decode step) leaves the engine exactly as the separate calls did."""

from __future__ import annotations

from dataclasses import replace

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


def state(eng: OffloadEngine) -> dict:
    """Everything sync_batch may change, as plain values."""
    return {
        "lut": eng.lut.table.clone(),
        "row_pages": eng.lut.row_pages.clone(),
        "res": eng.res_pages.clone(),
        "blocks": eng.res_blocks.clone(),
        "mp": eng.res_mpages.clone(),
        "count": eng.res_count.clone(),
        "reserve": eng.reserve.kv.clone(),
        "mirror": eng.mirror.kv.clone(),
        "owner": list(eng.owner),
        "free": len(eng.blocks),
        "rows": [
            None if st is None else (st.gen, st.n_chunks, list(st.mpages), dict(st.recall), list(st.ring))
            for st in eng.rows
        ],
        "metrics": untimed(eng.metrics()),
    }


def untimed(m: dict) -> dict:
    """Counters without the wall-clock latencies (they differ run to run)."""
    t = {k: v for k, v in m["total"].items() if "latency" not in k}
    t["last_cycle"] = {k: v for k, v in t["last_cycle"].items() if k != "latency_s"}
    return {
        "total": t,
        "requests": {rid: {k: v for k, v in r.items() if "latency" not in k} for rid, r in m["requests"].items()},
    }


def prepare(eng: OffloadEngine) -> None:
    """Rows 0 and 1 live (row 0 with 13 chunks and a recall), so the step below has something to finish."""
    eng.admit(0, *chunks(13, 1), rid="a")
    eng.admit(1, *chunks(9, 2), rid="b")
    eng.recaller.warm_start(0, 3)


def test_sync_batch_equals_the_separate_calls() -> None:
    old, new = OffloadEngine(LAYOUT, CFG), OffloadEngine(LAYOUT, CFG)
    prepare(old)
    prepare(new)
    kv2, ix2 = chunks(17, 3)
    r1, r2 = chunks(2, 4), chunks(1, 5)
    # The sequence begin_step used to make: finish, then per batch row admit + tail page + warm start, then one
    # decode_append per round of lagging rows.
    old.finish(0)
    old.admit(0, kv2, ix2, rid="c")
    old.open_tail_page(0)
    old.recaller.warm_start(0, 4)
    old.admit(2, *chunks(5, 6), rid="d")
    old.open_tail_page(2)
    old.recaller.warm_start(2, 4)
    c_old = [old.decode_append([0, 1], *r1), old.decode_append([1], *r2)]
    res = new.sync_batch(
        BatchSync(
            finished=(0,),
            rows=(
                RowSync(0, Admission(0, "c", 17, kv=kv2, index=ix2, warm_pages=4)),
                RowSync(1),
                RowSync(2, Admission(2, "d", 5, *chunks(5, 6), warm_pages=4)),
            ),
            appends=(AppendRound((0, 1), *r1), AppendRound((1,), *r2)),
        )
    )
    a, b = state(old), state(new)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
    assert [c.tolist() for c in res.cells] == [c.tolist() for c in c_old]
    assert res.n_chunks == {0: 18, 1: 11, 2: 5}
    assert res.mpages == {r: tuple(new.rows[r].mpages) for r in (0, 1, 2)}
    assert b["metrics"]["total"]["warm_start_pages"] > 0 and not check_invariants(new)


def test_sync_batch_claims_added_pages_before_the_appends() -> None:
    """Shrink-mode shape: pages owned by the caller, no bytes, cells only."""
    eng = OffloadEngine(LAYOUT, CFG)
    res = eng.sync_batch(BatchSync(rows=(RowSync(0, Admission(0, "x", 8, mpages=(5, 6))),)))
    assert res.mpages == {0: (5, 6)} and res.n_chunks == {0: 8}
    res = eng.sync_batch(BatchSync(rows=(RowSync(0, add_pages=(9,)),), appends=(AppendRound((0,)),)))
    assert res.mpages == {0: (5, 6, 9)} and res.n_chunks == {0: 9}
    assert int(res.cells[0][0]) >= 0 and int(eng.lut.table[9 * 4]) == int(res.cells[0][0])


def test_snapshot_rows_is_gen_and_length_of_live_rows() -> None:
    eng = OffloadEngine(LAYOUT, CFG)
    g0 = eng.admit(0, *chunks(6, 1))
    g3 = eng.admit(3, *chunks(2, 2))
    assert eng.snapshot_rows() == {0: (g0, 6), 3: (g3, 2)}
    eng.finish(0)
    assert eng.snapshot_rows() == {3: (g3, 2)}


def test_a_swapped_engine_lock_reaches_the_recaller() -> None:
    """`bench recall` wraps `engine.lock` to time holds: plan and publish must take the wrapped lock."""
    import threading

    from flashmemory.offload import RecallRequest, plan_recall, publish_recall

    class Counting:
        def __init__(self) -> None:
            self.inner, self.n = threading.RLock(), 0

        def __enter__(self):
            self.n += 1
            return self.inner.__enter__()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    eng = OffloadEngine(LAYOUT, CFG)
    gen = eng.admit(0, *chunks(13, 1))
    eng.lock = lock = Counting()
    assert eng.recaller.lock is lock
    plan = plan_recall(eng, [RecallRequest(0, gen, (0, 1), (1.0, 1.0))])
    planned = lock.n
    publish_recall(eng, plan)
    assert planned >= 1 and lock.n > planned


def test_stores_come_first_and_the_disk_tier_seals_their_bytes(tmp_path) -> None:
    """`BatchSync.stores` is applied before anything else: equal to `store_chunks` then the step, and with the disk
    tier the pages sealed in that step already hold the stored bytes (a sealed page never changes again)."""
    from flashmemory.offload.disk import HostPageCache, PageStore, disk_page_bytes
    from flashmemory.offload.disk.format import pack_page
    from flashmemory.offload.sync import ChunkStore
    from flashmemory.offload.tiered_mirror import TieredEngine

    pb = disk_page_bytes(LAYOUT)
    tiered = TieredEngine(LAYOUT, CFG, HostPageCache(PageStore(str(tmp_path), 16 * (pb + 8192), pb), 64 * pb))
    old, new = OffloadEngine(LAYOUT, CFG), OffloadEngine(LAYOUT, CFG)
    try:
        for eng in (old, new, tiered):
            eng.sync_batch(BatchSync(rows=(RowSync(0, Admission(0, "a", 7, *chunks(7, 1))),)))
            # a lagging row: two rounds close chunks 7 and 8 with stale bytes (page 1 fills, page 2 opens)
            eng.sync_batch(BatchSync(rows=(RowSync(0),), appends=(AppendRound((0,), *chunks(1, 2)),) * 2))
        m = torch.tensor([new.rows[0].mpages[1] * 4 + 3, new.rows[0].mpages[2] * 4], dtype=torch.int64)
        kv, ix = chunks(2, 3)
        fresh = ChunkStore(m, (0, 1, 2), kv, (ix[0], ix[1], ix[2]))
        step = BatchSync(rows=(RowSync(0),), appends=(AppendRound((0,), *chunks(1, 4)),), batch=(0,))
        old.store_chunks(m, [0, 1, 2], kv, [ix[0], ix[1], ix[2]])
        res_old = old.sync_batch(step)
        res_new = new.sync_batch(replace(step, stores=fresh))
        a, b = state(old), state(new)
        for k in a:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
        assert torch.equal(res_old.resident, res_new.resident)
        assert torch.equal(new.mirror.kv[:, m // 4, :], old.mirror.kv[:, m // 4, :])
        tiered.sync_batch(replace(step, stores=fresh))
        assert tiered.sealed[0][1] == 2  # page 1 (chunks 4..7) is sealed in this step ...
        assert tiered.held_page(0, 1) == bytes(pack_page(new.mirror, new.rows[0].mpages[1]))  # ... with chunk 7's
    finally:
        tiered.close()
