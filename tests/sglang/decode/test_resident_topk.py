import pytest
import torch

from flashmemory.retriever.fp8 import chunks_to_pages, quantize_chunks
from flashmemory.sglang.decode.resident_topk import (
    apply_resident_mask,
    paged_index_scores,
    pool_locs,
    remap_to_cells,
    resident_view,
)

pytestmark = pytest.mark.sglang
D, H = 128, 4


def _pool(n_pages, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_pages * 64, D, generator=g)
    return chunks_to_pages(quantize_chunks(keys))  # [n_pages, 64*132]


def _q(b, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, D, generator=g).to(torch.float8_e4m3fn)
    return q, torch.rand(b, H, generator=g)


def test_paged_scorer_matches_sglang_torch_reference(sg):
    ref_fn = sg["indexer"].fp8_paged_mqa_logits_torch
    pages = _pool(6)
    table = torch.tensor([[4, 1, 3], [0, 5, -1]], dtype=torch.int32)
    lens = torch.tensor([150, 70], dtype=torch.int32)
    q, w = _q(2)
    ref = ref_fn(q.unsqueeze(1), pages.view(6, 64, 1, D + 4), w, lens, table, None, 3 * 64, False)
    ours = paged_index_scores(q.float(), w, pages, table, lens)
    torch.testing.assert_close(ours, ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert ours[1, 70:].abs().sum() == 0


def test_resident_view_scores_equal_full_scores_on_resident_columns(sg):
    ref_fn = sg["indexer"].fp8_paged_mqa_logits_torch
    pages = _pool(8)
    table = torch.tensor([[7, 2, 5, 0, 3]], dtype=torch.int32)
    lens = torch.tensor([64 * 4 + 10], dtype=torch.int32)  # 5 logical pages, last partial
    sel = torch.tensor([[1, 3, -1]])
    vt, vl = resident_view(table, lens, sel, tail_pages=1)
    assert vt[0, :3].tolist() == [2, 0, 3] and vl.item() == 64 * 2 + 10
    q, w = _q(1)
    full = ref_fn(q.unsqueeze(1), pages.view(8, 64, 1, D + 4), w, lens, table, None, 5 * 64, False)
    view = ref_fn(q.unsqueeze(1), pages.view(8, 64, 1, D + 4), w, vl, vt, None, vt.shape[1] * 64, False)
    cols = torch.cat([torch.arange(64, 128), torch.arange(192, 256), torch.arange(256, 266)])
    torch.testing.assert_close(view[0, : vl.item()], full[0, cols])
    # sglang's own top-k over the view yields pool locs of resident chunks only
    out = torch.empty(1, 512, dtype=torch.int32)
    sg["indexer"].topk_transform_pytorch_vectorized(view, vl, vt, out, 64)
    got = set(out[0][out[0] >= 0].tolist())
    want = set(pool_locs(table, 5 * 64)[0, cols].tolist())
    assert got == want


def test_mask_mode_and_remap():
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    resident = torch.zeros(3 * 64, dtype=torch.bool)
    resident[2 * 64 : 2 * 64 + 5] = True  # logical chunks 0..4 of row 0
    logits = torch.randn(1, 128)
    apply_resident_mask(logits, table, resident)
    assert torch.isfinite(logits[0, :5]).all() and torch.isinf(logits[0, 5:]).all()
    lut = torch.full((3 * 64 + 1,), -1, dtype=torch.int32)
    lut[2 * 64 : 2 * 64 + 5] = torch.arange(5, dtype=torch.int32) + 100
    locs = torch.tensor([[128, 132, 3, -1]], dtype=torch.int32)
    assert remap_to_cells(locs, lut).tolist() == [[100, 104, -1, -1]]


def test_resident_view_dedups_tail_and_handles_empty_rows():
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    vt, vl = resident_view(table, torch.tensor([130, 0], dtype=torch.int32), torch.tensor([[0, 2], [-1, -1]]))
    assert vt[0, :2].tolist() == [0, 2] and vl.tolist() == [64 + 2, 0]


def test_full_selection_view_picks_exactly_what_stock_picks_past_512_chunks(sg):
    """Full budget = stock: with every page selected, sglang's own scorer + top-k over the view give the same
    pool locs in the same order as over the full table, also when the history is past index_topk (512) and
    scores tie (chunks with equal keys). A view narrower than the table broke ties differently."""
    ref_fn, topk = sg["indexer"].fp8_paged_mqa_logits_torch, sg["indexer"].topk_transform_pytorch_vectorized
    n_pages, width, n = 11, 16, 700  # 700 chunks > 512, table wider than the history
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(40, D, generator=g)[torch.randint(0, 40, (n_pages * 64,), generator=g)]  # many exact ties
    pages = chunks_to_pages(quantize_chunks(keys))
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)
    table = torch.cat([perm, torch.zeros(width - n_pages, dtype=torch.int32)]).view(1, -1)
    lens = torch.tensor([n], dtype=torch.int32)
    sel = torch.cat([torch.arange(n_pages), torch.full((1,), -1)]).view(1, -1)  # Level 1 kept every page
    vt, vl = resident_view(table, lens, sel, tail_pages=1)
    assert vt.shape == table.shape and vl.item() == n
    kv = pages.view(n_pages, 64, 1, D + 4)
    for seed in range(4):
        q, w = _q(1, seed=10 + seed)
        full = ref_fn(q.unsqueeze(1), kv, w, lens, table, None, width * 64, False)
        view = ref_fn(q.unsqueeze(1), kv, w, vl, vt, None, vt.shape[1] * 64, False)
        a, b = torch.empty(1, 512, dtype=torch.int32), torch.empty(1, 512, dtype=torch.int32)
        topk(full, lens, table, a, 64)
        topk(view, vl, vt, b, 64)
        # Same bits on both sides (the full selection's view IS the table: same scorer inputs and shapes), so even
        # the exact ties break alike and the picks must be equal, order included.
        assert torch.equal(a, b), f"seed {seed}: picks differ from stock at {(a != b).sum().item()} of 512"
