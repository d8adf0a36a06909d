"""Indexer query rope + Hadamard + fp8 quant against a float64 formula (explicit Sylvester matrix)."""

from __future__ import annotations

import torch

from flashmemory.retriever.hadamard import hadamard_matrix
from flashmemory.sglang.cpu.ops.indexer_q import fused_q_indexer_rope_hadamard_quant
from tests.sglang.cpu.test_norm_rope import _freqs, _rope64


def test_indexer_q_matches_float64():
    g = torch.Generator().manual_seed(0)
    b, h = 4, 16
    q = (torch.randn(b, h, 128, generator=g) * 2).bfloat16()
    q[1, 3] = 0  # all-zero head: the 1e-4 scale floor
    weights = torch.randn(b, 2 * h, generator=g).bfloat16()[:, :h]  # batch-strided, as sglang's wk slice
    ws = 128**-0.5 * h**-0.5
    pos = torch.tensor([0, 17, 1000, 65535])
    freqs, ang = _freqs(70000)
    q_fp8, w_out = fused_q_indexer_rope_hadamard_quant(q, weights, ws, freqs, pos)
    assert q_fp8.dtype == torch.float8_e4m3fn and q_fp8.shape == (b, h, 128) and w_out.shape == (b, h, 1)

    x = q.double()
    x = torch.cat([x[..., :64], _rope64(x[..., 64:], ang[pos].unsqueeze(1))], dim=-1)
    x = x @ hadamard_matrix(128).T / 128**0.5
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448
    deq = q_fp8.double() * scale
    err = (deq - x).abs()
    assert bool((err <= 2**-4 * x.abs() + 2**-10 * scale + 1e-6 * scale * 448).all())
    assert err.max() > 0
    assert torch.allclose(w_out.double(), weights.double().unsqueeze(-1) * ws * scale, rtol=1e-5, atol=1e-12)
    # The indexer logit sglang forms from these, sum_h relu(q_fp8 . k) * w_out, tracks the exact one.
    k = torch.randn(7, 128, generator=g, dtype=torch.float64)
    logit = (torch.relu(q_fp8.double() @ k.T) * w_out.double()).sum(1)
    exact = (torch.relu(x @ k.T) * weights.double().unsqueeze(-1) * ws).sum(1)
    assert torch.allclose(logit, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())
