"""fp8 paged stores: exact bytes against a reference written here (torch's float8_e4m3fn cast of float64 math)."""

from __future__ import annotations

import math

import pytest
import torch

from flashmemory.retriever.fp8 import dequantize_chunks
from flashmemory.sglang.cpu.ops.stores import (
    dequantize_kv_entries,
    fused_store_cache,
    quantize_index_entries,
    quantize_kv_entries,
    store_index_entries,
    store_kv_entries,
)

E4M3 = torch.float8_e4m3fn


def _entries_input(n: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g) * torch.logspace(-3, 2, n).unsqueeze(1)
    x[0, 0:64] = 0  # all-zero group: the 1e-4 amax floor
    x[1, 64:128] = torch.randn(64, generator=g) * 1e-6  # tiny group: subnormal fp8 values
    x[2, 128:192] *= torch.logspace(-4, 0, 64)  # wide range inside one group
    x[3, 192] = 448.0 * 2**-3  # amax / 448 an exact power of two
    x[3, 193:256] = x[3, 193:256].clamp(-50, 50)
    return x


def _reference_kv_row(x: torch.Tensor, round_nope: bool) -> bytes:
    """One 584-B entry from the format: per 64-group s = 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3(x / s)."""
    out = bytearray()
    nope = x[:448].double()
    if round_nope:
        nope = x[:448].bfloat16().double()
    exps = []
    for gi in range(7):
        grp = nope[gi * 64 : (gi + 1) * 64]
        k = math.ceil(math.log2(max(grp.abs().max().item(), 1e-4) / 448.0))
        exps.append(k + 127)
        out += (grp / 2.0**k).clamp(-448, 448).to(E4M3).view(torch.uint8).numpy().tobytes()
    out += x[448:].bfloat16().view(torch.uint8).numpy().tobytes()
    return bytes(out) + bytes(exps) + b"\x00"


@pytest.mark.parametrize("round_nope", [False, True])
def test_kv_entry_bytes_match_reference(round_nope):
    x = _entries_input()
    got = quantize_kv_entries(x, round_nope_to_bf16=round_nope)
    assert got.shape == (x.shape[0], 584)
    for i in range(x.shape[0]):
        assert got[i].numpy().tobytes() == _reference_kv_row(x[i], round_nope), f"row {i}"


def test_kv_entry_dequantizes_within_fp8_bound():
    x = _entries_input(seed=1)
    deq = dequantize_kv_entries(quantize_kv_entries(x, round_nope_to_bf16=False))
    rows = quantize_kv_entries(x, round_nope_to_bf16=False)
    s = (rows[:, 576:583].to(torch.int32) << 23).view(torch.float32).repeat_interleave(64, dim=1)
    err = (deq - x).abs()
    assert bool((err[:, :448] <= 2**-4 * x[:, :448].abs() + 2**-10 * s).all())
    assert bool((err[:, 448:] <= 2**-8 * x[:, 448:].abs()).all())
    assert err[:, :448].max() > 0  # the check sees quantization at all


def test_index_entry_bytes_match_reference():
    x = _entries_input(seed=2)[:, :128].clone()
    x[0] = 0
    got = quantize_index_entries(x)
    for i in range(x.shape[0]):
        amax = max(x[i].abs().max().item(), 1e-4)
        scale = torch.tensor(amax, dtype=torch.float32) / 448.0  # fp32 scale, not a power of two
        q = (x[i] * (1.0 / scale)).clamp(-448, 448).to(E4M3).view(torch.uint8)
        want = q.numpy().tobytes() + scale.reshape(1).numpy().tobytes()
        assert got[i].numpy().tobytes() == want, f"row {i}"
    deq = dequantize_chunks(got)
    s = got[:, 128:].contiguous().view(torch.float32)
    assert bool(((deq - x).abs() <= 2**-4 * x.abs() + 2**-10 * s).all())


def test_kv_paged_write_places_bytes_and_keeps_pad():
    page, pages = 64, 3
    page_bytes = math.ceil(page * 584 / 576) * 576
    assert page_bytes == 37440
    g = torch.Generator().manual_seed(3)
    pool = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=g)
    before = pool.clone()
    x = _entries_input(seed=4)[:4]
    locs = torch.tensor([0, 130, -1, 191])  # page 0 slot 0, page 2 slot 2, skipped, page 2 slot 63
    store_kv_entries(pool, locs, x, page, round_nope_to_bf16=False)
    rows = quantize_kv_entries(x, round_nope_to_bf16=False)
    expect = before.clone().view(-1)
    for i, loc in enumerate(locs.tolist()):
        if loc < 0:
            continue
        p, s = divmod(loc, page)
        base = p * page_bytes
        expect[base + s * 576 : base + s * 576 + 576] = rows[i, :576]
        expect[base + page * 576 + s * 8 : base + page * 576 + s * 8 + 7] = rows[i, 576:583]  # pad byte kept
    assert torch.equal(pool.view(-1), expect)


def test_index_paged_write_places_bytes():
    page = 64
    pool = torch.zeros(2, page * 132, dtype=torch.uint8)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(5))
    store_index_entries(pool, torch.tensor([65, 3]), x, page)
    rows = quantize_index_entries(x)
    flat = pool.view(-1)
    for i, loc in enumerate([65, 3]):
        p, s = divmod(loc, page)
        base = p * page * 132
        assert torch.equal(flat[base + s * 128 : base + s * 128 + 128], rows[i, :128])
        assert torch.equal(flat[base + page * 128 + s * 4 : base + page * 128 + s * 4 + 4], rows[i, 128:])
    assert int((pool != 0).sum()) <= 2 * 132


def test_fused_store_cache_dropin():
    page = 64
    x = _entries_input(seed=6)[:3].bfloat16()
    kv_pool = torch.zeros(2, 37440, dtype=torch.uint8)
    fused_store_cache(x, kv_pool, torch.tensor([5, 70, 9]), page_size=page, type="flashmla")
    ref = torch.zeros_like(kv_pool)
    store_kv_entries(ref, torch.tensor([5, 70, 9]), x.float(), page, round_nope_to_bf16=False)
    assert torch.equal(kv_pool, ref) and int(kv_pool.count_nonzero()) > 0
    ix_pool = torch.zeros(1, page * 132, dtype=torch.uint8)
    fused_store_cache(x[:, :128], ix_pool, torch.tensor([1, 2, 3]), page_size=page, type="indexer")
    ix_ref = torch.zeros_like(ix_pool)
    store_index_entries(ix_ref, torch.tensor([1, 2, 3]), x[:, :128].float(), page)
    assert torch.equal(ix_pool, ix_ref) and int(ix_pool.count_nonzero()) > 0
    with pytest.raises(NotImplementedError, match="V4 layout"):
        fused_store_cache(x, kv_pool, torch.tensor([0, 1, 2]), page_size=page, type="flashmla", layout="v41")
