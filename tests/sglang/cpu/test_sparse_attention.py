"""The page-dequantizing sparse attention equals sglang's own torch sparse decode on the same fp8 pools."""

import pytest
import torch

from flashmemory.sglang.cpu.ops.sparse_attention import sparse_decode_fwd
from flashmemory.sglang.cpu.ops.stores import store_kv_entries

pytestmark = pytest.mark.sglang


def _pool(n_pages: int, page: int, fill: int, gen: torch.Generator) -> torch.Tensor:
    """A V4 KV pool of n_pages pages (584-B entries, page rows padded to 576 B), `fill` random entries written."""
    page_bytes = -(-page * 584 // 576) * 576
    raw = torch.zeros(n_pages * page_bytes, dtype=torch.uint8)
    x = torch.randn(fill, 512, generator=gen) * 3
    store_kv_entries(raw, torch.arange(fill), x, page, round_nope_to_bf16=True)
    return (
        raw.view(n_pages, page_bytes)[:, : page * 584]
        .as_strided((n_pages, page, 1, 584), (page_bytes, 584, 584, 1))
        .view(torch.float8_e4m3fn)
    )


@pytest.mark.parametrize("b,heads,sink", [(3, 8, True), (70, 4, False)])
def test_matches_sglang_torch_sparse_decode(b, heads, sink):
    ref = pytest.importorskip("sglang.kernels.ops.attention.flash_mla_sm120")._sm120_sparse_decode_fwd
    g = torch.Generator().manual_seed(b)
    swa, c4 = _pool(4, 256, 700, g), _pool(3, 64, 150, g)
    q = (torch.randn(b, 1, heads, 512, generator=g) * 0.2).bfloat16()
    idx = torch.randint(-1, 700, (b, 1, 40), generator=g, dtype=torch.int32)
    eidx = torch.randint(-1, 150, (b, 1, 24), generator=g, dtype=torch.int32)
    lens = torch.randint(0, 41, (b,), generator=g, dtype=torch.int32)
    elens = torch.randint(0, 25, (b,), generator=g, dtype=torch.int32)
    lens[0], elens[0] = 0, 0  # a token with no pick at all
    s = torch.randn(heads, generator=g) if sink else None
    args = (q, swa, idx, lens, s, 512, 0.05, c4, eidx, elens)
    out, lse = sparse_decode_fwd(*args)
    want_out, want_lse = ref(*args)
    assert out.dtype == want_out.dtype == torch.bfloat16 and out.shape == want_out.shape
    torch.testing.assert_close(out.float(), want_out.float(), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert bool((out[0] == 0).all())
