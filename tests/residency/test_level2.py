"""Level 2: both modes equal the native top-k when everything is resident, and the masked top-k otherwise."""

from __future__ import annotations

import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, RecallRequest, recall_now
from flashmemory.residency.level2 import Level2, paged_index_logits
from flashmemory.retriever.fp8 import FP8

LAYOUT = OffloadLayout(n_layers=3, page_chunks=8, kv_widths=(6, 2), kv_align=4, index_head_dim=4, target_layers=(1,))


def exact_index_chunks(n: int, offset: int, d: int = 4) -> torch.Tensor:
    """Index chunks whose logits are exact distinct integers: k = (1, 0, ..) * scale, scale = offset + n_i."""
    vals = torch.zeros(n, d)
    vals[:, 0] = 1.0
    scale = (torch.randperm(n).float() + offset).view(n, 1)
    return torch.cat((vals.to(FP8).view(torch.uint8), scale.view(torch.uint8)), dim=1)


def make(n_rows: int = 3, n: int = 60) -> tuple[OffloadEngine, list[int]]:
    eng = OffloadEngine(
        LAYOUT, EngineConfig(max_rows=4, max_chunks=64, recall_blocks=32, decode_pages=1, max_resident_pages=8)
    )
    gens = []
    for r in range(n_rows):
        kv = torch.randint(0, 256, (3, n, 8), dtype=torch.uint8)
        ix = torch.stack([exact_index_chunks(n, 1 + 100 * r) for _ in range(3)])
        gens.append(eng.admit(r, kv, ix))
    return eng, gens


def native_logits(eng: OffloadEngine, layer: int, q, w, rows: list[int]) -> torch.Tensor:
    pages = eng.target.pages[0] if layer == 1 else None
    if pages is None:  # non-target layers live in the mirror: build their full paged index-K
        pages = eng.mirror.index[eng.layout.offload_index_layers.index(layer)]
    table = eng.lut.row_pages[rows]
    return paged_index_logits(q, w, pages, table, LAYOUT.page_chunks)[:, : eng.cfg.max_chunks]


def check(eng, gens, sel: dict[int, tuple[int, ...]], k: int = 12):
    recall_now(eng, [RecallRequest(r, gens[r], p, tuple(1.0 for _ in p)) for r, p in sel.items()])
    l2 = Level2(eng, max_batch=4, topk=16)
    rows = list(sel)
    q = torch.zeros(len(rows), 2, 4)
    q[:, :, 0] = 1.0
    w = torch.ones(len(rows), 2)
    for layer in (0, 1):
        logits = native_logits(eng, layer, q, w, rows)
        n_hist = torch.tensor([eng.n_chunks(r) for r in rows])
        logits[torch.arange(logits.shape[1]).unsqueeze(0) >= n_hist.unsqueeze(1)] = float("-inf")
        res = eng.cells(torch.tensor(rows), torch.arange(logits.shape[1]).expand(len(rows), -1)) >= 0
        want = logits.masked_fill(~res, float("-inf")).topk(k, dim=1)
        for mode in ("mask", "score"):
            out = (
                l2.mask_topk(logits, torch.tensor(rows), k)
                if mode == "mask"
                else l2.score_resident_topk(q, w, torch.tensor(rows), layer, k)
            )
            valid = want.values > float("-inf")
            exp = torch.where(valid, want.indices, -1)
            # Exact on any machine: the logits are distinct small integers (exact_index_chunks), no near-tie.
            assert torch.equal(out.chunks.sort(1).values, exp.sort(1).values), (mode, layer, out.chunks, exp)
            assert torch.equal(out.values.sort(1).values, want.values.sort(1).values), (mode, layer)
    return logits


def test_full_residency_equals_native_topk():
    eng, gens = make()
    allp = tuple(range(8))
    logits = check(eng, gens, {0: allp, 1: allp, 2: allp})
    assert torch.isfinite(logits[:, :60]).all()


def test_partial_residency_equals_masked_topk():
    eng, gens = make()
    check(eng, gens, {0: (0, 3), 1: (7,), 2: (1, 2, 5)})


def test_few_resident_chunks_marks_rest_invalid():
    eng, gens = make(n_rows=1)
    recall_now(eng, [RecallRequest(0, gens[0], (7,), (1.0,))])  # 4 valid chunks on the last page (60 = 7*8 + 4)
    l2 = Level2(eng, max_batch=2, topk=16)
    out = l2.mask_topk(torch.randn(2, 64), torch.tensor([0, -1]), 16)
    assert int((out.chunks[0] >= 0).sum()) == 4 and (out.chunks[1] == -1).all() and (out.cells[1] == -1).all()
    q, w = torch.randn(2, 2, 4), torch.rand(2, 2)
    out = l2.score_resident_topk(q, w, torch.tensor([0, -1]), 1, 16)
    assert int((out.chunks[0] >= 0).sum()) == 4 and sorted(out.chunks[0][:4].tolist()) == [56, 57, 58, 59]


def test_static_buffers_and_bad_shapes():
    eng, gens = make(n_rows=1)
    l2 = Level2(eng, max_batch=2, topk=8)
    ptr = l2.out_chunks.data_ptr()
    for b in (1, 2):
        l2.mask_topk(torch.randn(b, 64), torch.tensor([0] * b))
        assert l2.out_chunks.data_ptr() == ptr
    try:
        l2.mask_topk(torch.randn(3, 64), torch.tensor([0, 0, 0]))
        raise AssertionError("batch above max_batch must be refused")
    except ValueError as e:
        assert "max_batch" in str(e)
