"""Stream discipline of the serving path, proven with the recording stand-in for torch.cuda (tests/support).

sglang enqueues decode forwards on a stream of its own (not the one current when the pool was built), and
DeepSeek-V4's indexer reads on `stream_indexer`, forked from and joined back into it. The serving runtime here
drives the offload adapter (admissions, decode steps, Level-1 cycles on the worker thread: plan, side-stream
recall copy, table publish) with such a forward stream, and every access to the reserve blocks, the lookup
table and the resident tables is logged on the stream it is enqueued on. The checks are happens-before ones:
each recall copy is complete before any forward that reads its block, a copy into a reused (victim) block
waits for every forward that read the victim's bytes, and no table write is unordered against a forward's read.
"""

import types

import pytest
import torch

from flashmemory.offload import recall as recall_mod
from flashmemory.offload.lut import ChunkLUT
from flashmemory.offload.rows import ResidentTables
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.runtime import Runtime
from tests.sglang.decode.test_copy_adapter import PAGE, env, fake_pool
from tests.support.cuda_standin import install

pytestmark = pytest.mark.sglang
REQS = {"a": [5, 2, 9, 7], "b": [0, 1, 3, 4]}  # pool pages per request, logical order
SEQ0 = 3 * PAGE + 200  # tokens before the first decode step: 4 c4 pages


def _log_writes(monkeypatch, si):
    """Log every lookup-table / resident-table write and every recall copy into reserve blocks."""
    for name in ("set_range", "set", "clear_page", "clear_pages", "set_pages"):
        orig = getattr(ChunkLUT, name)
        monkeypatch.setattr(
            ChunkLUT, name, lambda self, *a, _o=orig, **k: (si.op("write", "lut"), _o(self, *a, **k))[1]
        )
    orig_rebuild = ResidentTables.rebuild
    monkeypatch.setattr(
        ResidentTables, "rebuild", lambda self, rows: (si.op("write", "tables"), orig_rebuild(self, rows))[1]
    )
    orig_copy = recall_mod.gather_copy

    def gather_copy(src, dst, src_idx, dst_idx, stage=None):
        for b in dst_idx.tolist():
            si.op("write", ("block", int(b)))
        return orig_copy(src, dst, src_idx, dst_idx, stage)

    monkeypatch.setattr(recall_mod, "gather_copy", gather_copy)


def _batch(rids, seqs):
    mode = types.SimpleNamespace(is_decode=lambda: True, is_idle=lambda: False)
    return types.SimpleNamespace(
        forward_mode=mode,
        rids=list(rids),
        seq_lens=torch.tensor(seqs),
        req_pool_indices=torch.tensor([1 + i for i in range(len(rids))]),
    )


def _forward(si, adapter, fwd, idx_stream, rids, seqs):
    """What a decode forward reads: the indexer (on its own stream, forked from and joined into the forward
    stream) maps every history loc through the lookup table; attention reads the blocks the cells name."""
    idx_stream.wait_stream(fwd)
    blocks = set()
    with torch.cuda.stream(idx_stream):
        for rid, s in zip(rids, seqs):
            n = s // 4
            pages = REQS[rid]
            locs = torch.tensor([pages[c // 64] * 64 + c % 64 for c in range(n)]).view(1, -1)
            si.op("read", "lut")
            cells = adapter.cells_of(locs)[0]
            blocks |= {int(c) // 64 for c in cells[cells >= 0].tolist()}
    fwd.wait_stream(idx_stream)
    for b in sorted(blocks):
        si.op("read", ("block", b))


def test_recall_and_tables_are_ordered_against_the_forward_stream(monkeypatch):
    si = install(monkeypatch)
    _log_writes(monkeypatch, si)
    pool = fake_pool(5)
    adapter = build(
        pool, env("", async_recall=True, interval=2, page_kmax=2, reserve_pages=4, last_keep=16), shrink=False
    )
    cycle = [0]

    def rotating(row, n_hist, hidden, position):  # each cycle favours another old page: the selection moves
        cycle[0] += 1
        s = torch.zeros(n_hist)
        p = (cycle[0] + row) % 3
        s[p * 64 : (p + 1) * 64] = 1.0
        return s

    adapter.l1.scorer = rotating
    orig_pages = adapter.resident_pages
    adapter.resident_pages = lambda rows: (si.op("read", "tables"), orig_pages(rows))[1]
    rt = Runtime()
    rt.engine, rt.pool, rt.env, rt.diag_path = adapter, pool, adapter.env, ""
    r2t = torch.full((3, 4 * PAGE), -1, dtype=torch.int64)
    for i, pages in enumerate(REQS.values()):
        r2t[1 + i] = torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)])
    fwd, idx_stream = torch.cuda.Stream(), torch.cuda.Stream()  # sglang's forward stream, DSv4's indexer stream
    rids = list(REQS)
    try:
        for step in range(14):
            seqs = [SEQ0 + 1 + step, SEQ0 + 3 + step]
            fb = _batch(rids, seqs)
            with torch.cuda.stream(fwd):  # the scheduler enters the forward stream around each batch
                rt.before_forward(fb, r2t)
                _forward(si, adapter, fwd, idx_stream, rids, seqs)
                rt.after_decode_forward(fb)
            adapter.l1.wait()  # the worker's cycle publishes before the next step
    finally:
        adapter.close()
    stats = adapter.engine.metrics()["total"]
    copies = [o for o in si.ops("write") if isinstance(o.resource, tuple)]
    reads = [o for o in si.ops("read") if isinstance(o.resource, tuple)]
    assert stats["cycles"] >= 4 and stats["evictions"] >= 2 and copies
    reused = {o.resource for o in copies} & {o.resource for o in reads if o.index < max(c.index for c in copies)}
    assert reused, "no block was read and then overwritten by a recall: the test would prove nothing"
    assert any(o.thread == "flashmemory-level1" for o in copies), "no recall ran on the worker thread"
    # Each recall copy is complete before any forward that reads its block (after it in host order).
    for r in reads:
        before = [w for w in copies if w.resource == r.resource and w.index < r.index]
        if before:
            assert r.after(before[-1]), f"forward read {r} may run before recall copy {before[-1]}"
    # No access pair is left to chance: victims' old readers before their copy, table writes vs. forward reads.
    races = si.races(lambda res: True)
    assert races == [], f"{len(races)} unordered pairs, e.g. {races[0]}"
