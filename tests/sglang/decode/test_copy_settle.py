"""Copy mode's settle with streams (the recording torch.cuda stand-in): the chunks a forward closed reach the host
mirror with the bytes sglang stored in its pool, through the core's pinned staging (`OffloadEngine.stage_chunks`:
one pending land per row, applied at a later step), with no host read on the decode thread.

Two requests decode on a forward stream through the runtime's hooks; every chunk a step closes gets new bytes in
the pool during that step's forward (what sglang's c4 store kernel does). After the run every closed chunk's mirror
bytes equal the pool's and the core's invariants hold.
"""

from __future__ import annotations

import types

import pytest
import torch

from flashmemory.bench.standin_blocking import on_thread
from flashmemory.offload import check_invariants
from flashmemory.offload.landing import DeviceLanding
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.geometry import c4_counts
from flashmemory.sglang.decode.runtime import Runtime
from tests.sglang.decode.test_copy_adapter import N_C4, PAGE, env, fake_pool, write_chunk
from tests.support.cuda_standin import count_blocking

pytestmark = pytest.mark.sglang
REQS = {"a": [5, 2, 9, 7], "b": [0, 1, 3, 4]}  # pool pages per request, logical order
SEQ0 = 2 * PAGE - 9  # 503 tokens: chunks close every fourth step, page 2 opens at 513


def _loc(rid: str, chunk: int) -> int:
    return REQS[rid][chunk // 64] * 64 + chunk % 64


def test_closed_chunks_reach_the_mirror_through_pinned_staging(monkeypatch):
    count_blocking(monkeypatch)
    staged: list[int] = []
    orig = DeviceLanding.stage_chunks

    def stage_chunks(self, rows, m, kv, index):
        staged.append(len(rows))
        return orig(self, rows, m, kv, index)

    monkeypatch.setattr(DeviceLanding, "stage_chunks", stage_chunks)
    pool = fake_pool(5)
    adapter = build(pool, env("", async_recall=True, interval=4, page_kmax=2, reserve_pages=6), shrink=False)
    rt = Runtime()
    rt.engine, rt.pool, rt.env, rt.diag_path = adapter, pool, adapter.env, ""
    r2t = torch.full((3, 4 * PAGE), -1, dtype=torch.int64)
    for i, pages in enumerate(REQS.values()):
        r2t[1 + i] = torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)])
    fwd = torch.cuda.Stream()
    rids, closed = list(REQS), {r: 0 for r in REQS}
    mode = types.SimpleNamespace(is_decode=lambda: True, is_idle=lambda: False)
    try:
        for step in range(14):
            seq = SEQ0 + 1 + step
            fb = types.SimpleNamespace(
                forward_mode=mode,
                rids=rids,
                seq_lens=torch.full((2,), seq, dtype=torch.int64),
                req_pool_indices=torch.tensor([1, 2]),
            )
            with torch.cuda.stream(fwd):
                rt.before_forward(fb, r2t)
                before, after = c4_counts(torch.tensor([seq]))
                if int(after) > int(before):  # the forward stores the chunk it closes
                    for i, rid in enumerate(rids):
                        write_chunk(pool, _loc(rid, int(before)), seed=seq * 10 + i)
                        closed[rid] = int(after)
                rt.after_decode_forward(fb)
            adapter.l1.wait()
        assert staged and sum(staged) >= 6, staged  # three closing steps of two requests, settled a step later
        settle_ops = [b for b in on_thread() if b.function in ("stage_chunks", "_land_now", "settle_before_step")]
        assert not settle_ops, settle_ops
        adapter.engine.flush_lands()
        assert check_invariants(adapter.engine) == []
        st, lay = adapter.engine.storage(), adapter.layout
        for rid in rids:
            row = adapter.rows[rid]
            for c in range((SEQ0 - 1) // 4, closed[rid]):
                m = adapter.mpages[row][c // 64] * 64 + c % 64
                mirror = lay.kv.read_chunks(st.mirror_kv, torch.tensor([m // 64]), torch.tensor([m % 64]))
                loc = _loc(rid, c)
                kv = torch.stack(pool.c4_kv_pool.kv_buffer[:N_C4])
                assert torch.equal(mirror, lay.kv.read_chunks(kv, torch.tensor([loc // 64]), torch.tensor([c % 64])))
    finally:
        adapter.close()
