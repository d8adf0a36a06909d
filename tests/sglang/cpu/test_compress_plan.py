"""The CPU compressor planner: plan bytes worked out by hand from c_plan.cuh's rules for small cases."""

from __future__ import annotations

import pytest
import torch

from flashmemory.sglang.cpu.ops.compress_plan import plan_decode, plan_prefill, unpack_plan_c, unpack_plan_w
from flashmemory.sglang.cpu.patches_kernels import generate_decode, generate_prefill


def _tables():
    """Request slot 1: full loc 100 + pos; full loc -> SWA loc 32 + pos (SWA page 2 of 16 tokens).
    The c4 ring row of position p is then 2 * 8 + p % 8 = 16 + p % 8."""
    r2t = torch.zeros(3, 64, dtype=torch.int32)
    r2t[1] = 100 + torch.arange(64, dtype=torch.int32)
    f2s = torch.full((200,), -7, dtype=torch.int64)
    f2s[100:164] = 32 + torch.arange(64)
    return torch.tensor([1]), r2t, f2s


def _rows(t: torch.Tensor) -> list[list[int]]:
    return t.contiguous().view(torch.int32).tolist()


def test_c4_prefill_first_chunk():
    rid, r2t, f2s = _tables()
    plan_c, plan_w = plan_prefill(4, rid, torch.tensor([10]), torch.tensor([10]), r2t, f2s, 16, 8, 10)
    # Windows close at positions 3 (4 of its 8 slots would come from the ring: seq_len 4 has no previous
    # window, the kernel masks them) and 7 (all 8 slots from this chunk: no ring read, pages left as planned).
    assert _rows(plan_c) == [[4, 3 | 4 << 16, 4, 4], [8, 7, -1, 0]]
    # Kept in the ring: positions >= last window start - 4 = 4, at rows 16 + p % 8.
    assert _rows(plan_w) == [[4, 20], [5, 21], [6, 22], [7, 23], [8, 16], [9, 17]]


def test_c4_prefill_second_chunk_reads_the_ring():
    rid, r2t, f2s = _tables()
    plan_c, plan_w = plan_prefill(4, rid, torch.tensor([13]), torch.tensor([3]), r2t, f2s, 16, 8, 3)
    pc = unpack_plan_c(plan_c)
    # Window closing at 11: slots 0..5 (positions 4..9) from the ring, pages of positions 7 (row 23) and 11 (row 19).
    assert pc.seq_len.tolist() == [12] and pc.ragged_id.tolist() == [1] and pc.buffer_len.tolist() == [6]
    assert pc.read_page_0.tolist() == [5] and pc.read_page_1.tolist() == [4]
    assert _rows(plan_w) == [[0, 18], [1, 19], [2, 20]]


def test_c4_keeps_the_last_tokens_of_every_swa_page():
    rid, r2t, f2s = _tables()
    _, plan_w = plan_prefill(4, rid, torch.tensor([40]), torch.tensor([40]), r2t, f2s, 16, 8, 40)
    w = unpack_plan_w(plan_w)
    # Positions 12..15 and 28..31 end SWA pages (page-scoped ring) and are kept besides the tail: the last
    # closed window's 4 tokens 36..39, whose Ca halves the next window (40..43) reads.
    assert w.ragged_id.tolist() == [12, 13, 14, 15, 28, 29, 30, 31, 36, 37, 38, 39]


def test_c4_and_c128_decode_plans():
    rid, r2t, f2s = _tables()
    # c4, token at position 15: write row 16 + 7 = 23, previous window's page = page of position 11 (row 19).
    assert _rows(plan_decode(4, rid, r2t, f2s, torch.tensor([16]), 16, 8)) == [[16, 23, 4, 5]]
    # c128: one ring of 128 rows per request slot: position 299 -> row 128 + 43, page 1 (= the slot).
    assert _rows(plan_decode(128, rid, r2t, f2s, torch.tensor([300]), 256, 128)) == [[300, 171, 1, 1]]


def test_two_requests_ragged_ids_and_graph_padding():
    r2t = torch.arange(4 * 300, dtype=torch.int32).view(4, 300)
    f2s = torch.arange(1200, dtype=torch.int64)
    plan_c, plan_w = plan_prefill(
        128,
        torch.tensor([3, 0]),
        torch.tensor([130, 140]),
        torch.tensor([10, 20]),
        r2t,
        f2s,
        256,
        128,
        30,
        use_cuda_graph=True,
    )
    assert plan_c.shape == (30, 16) and plan_w.shape == (30, 8)
    pc = unpack_plan_c(plan_c)
    # Request 0 (slot 3) closes its window at position 127 = its 8th extend token (ragged 7);
    # request 1 (slot 0) at 127 too = its extend index 7 -> ragged 10 + 7.
    assert pc.valid.tolist() == [True, True] + [False] * 28
    assert pc.ragged_id[:2].tolist() == [7, 17]
    assert pc.buffer_len[:2].tolist() == [120, 120] and pc.read_page_1[:2].tolist() == [3, 0]
    assert _rows(plan_c[2:3]) == [[-1, 0, -1, -1]] and _rows(plan_w[-1:]) == [[-1, -1]]


def test_bad_input_is_named():
    rid, r2t, f2s = _tables()
    with pytest.raises(ValueError, match="extend_len"):
        plan_prefill(4, rid, torch.tensor([3]), torch.tensor([4]), r2t, f2s, 16, 8, 4)
    with pytest.raises(ValueError, match="compress_ratio"):
        plan_decode(8, rid, r2t, f2s, torch.tensor([3]), 16, 8)


def test_dropins_return_sglang_plan_types():
    compress = pytest.importorskip("sglang.kernels.ops.attention.dsv4.compress")
    rid, r2t, f2s = _tables()
    p = generate_prefill(4, rid, torch.tensor([10]), torch.tensor([10]), r2t, f2s, 16, 8, 10)
    assert isinstance(p, compress.CompressorPrefillPlan) and not p.is_decode and p.compress_ratio == 4
    assert _rows(p.plan_c)[0] == [4, 3 | 4 << 16, 4, 4]
    d = generate_decode(4, rid, r2t, f2s, torch.tensor([16]), 16, 8)
    assert isinstance(d, compress.CompressorDecodePlan) and d.is_decode and _rows(d.plan_d) == [[16, 23, 4, 5]]
