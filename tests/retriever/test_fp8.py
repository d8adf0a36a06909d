"""fp8 chunk codec and the paged index-K layout, checked byte for byte."""

from __future__ import annotations

import pytest
import torch

from flashmemory.retriever.fp8 import (
    chunk_bytes,
    chunks_to_pages,
    dequantize_chunks,
    pages_to_chunks,
    quantize_chunks,
    split_chunks,
)


def keys(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, d, generator=g) * torch.logspace(-3, 2, n).unsqueeze(1)
    k[0] = 0.0  # an all-zero key: scale floors at eps / 448
    return k


@pytest.mark.parametrize("d", [16, 128])
def test_quantize_dequantize_matches_torch_cast(d: int) -> None:
    k = keys(77, d)
    c = quantize_chunks(k)
    assert c.dtype == torch.uint8 and c.shape == (77, chunk_bytes(d)) and chunk_bytes(d) == d + 4
    scale = k.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    want = (k / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(dequantize_chunks(c), want)
    # Bytes: [0:D] are the fp8 codes, [D:D+4] the little-endian float32 scale.
    assert torch.equal(c[:, :d], (k / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(c[:, d:].contiguous().view(torch.float32), scale)
    assert bytes(c[5, d:].tolist()) == scale[5].numpy().astype("<f4").tobytes()
    vals, s = split_chunks(c)
    assert vals.dtype == torch.float8_e4m3fn and s.shape == (77,)
    # Each chunk's largest magnitude maps to the fp8 maximum (448).
    assert torch.all(vals[1:].float().abs().amax(-1) == 448.0)


def test_dequantize_keeps_leading_dims() -> None:
    c = quantize_chunks(keys(12, 16)).view(3, 4, 20)
    assert torch.equal(dequantize_chunks(c).view(12, 16), dequantize_chunks(c.view(12, 20)))


@pytest.mark.parametrize("n,d", [(64, 128), (100, 128), (1, 16), (130, 16)])
def test_page_layout_round_trip_and_offsets(n: int, d: int) -> None:
    c = quantize_chunks(keys(n, d, seed=n))
    pages = chunks_to_pages(c)
    n_pages = -(-n // 64)
    cb = d + 4
    assert pages.dtype == torch.uint8 and pages.shape == (n_pages, 64 * cb)
    flat = pages.reshape(-1)
    for j in sorted({0, min(1, n - 1), min(63, n - 1), min(64, n - 1), n - 1}):
        p, r = divmod(j, 64)
        base = p * 64 * cb
        assert torch.equal(flat[base + r * d : base + (r + 1) * d], c[j, :d])  # fp8 block
        assert torch.equal(flat[base + 64 * d + 4 * r : base + 64 * d + 4 * r + 4], c[j, d:])  # scale block
    # The tail of the last page is zero bytes.
    pad = n_pages * 64 - n
    if pad:
        last = pages[-1]
        assert torch.all(last[(64 - pad) * d : 64 * d] == 0) and torch.all(last[64 * d + (64 - pad) * 4 :] == 0)
    back = pages_to_chunks(pages, n, d)
    assert back.dtype == torch.uint8 and torch.equal(back, c)


def test_page_layout_errors() -> None:
    pages = chunks_to_pages(quantize_chunks(keys(10, 16)))
    with pytest.raises(ValueError, match="head_dim=128"):
        pages_to_chunks(pages, 10, 128)
    with pytest.raises(ValueError, match="do not fit"):
        pages_to_chunks(pages, 65, 16)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        quantize_chunks(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_chunks(torch.randn(3, 20))
