"""Clamped SwiGLU against a float64 formula."""

from __future__ import annotations

import torch

from flashmemory.sglang.cpu.ops.activation import silu_and_mul_clamp


def test_silu_and_mul_clamp_matches_float64():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 2 * 96, generator=g) * 8).bfloat16()  # many values beyond +-10
    x[0, :4] = torch.tensor([10.0, 10.5, -30.0, 1e4]).bfloat16()
    out = torch.empty(9, 96, dtype=torch.bfloat16)
    silu_and_mul_clamp(x, out, 10.0)
    gate, up = x[:, :96].double().clamp(max=10.0), x[:, 96:].double().clamp(-10.0, 10.0)
    want = gate / (1 + torch.exp(-gate)) * up
    err = (out.double() - want).abs()
    assert bool((err <= 2**-8 * want.abs() + 1e-30).all())
    assert (out.double() == want.bfloat16().double()).float().mean() > 0.98
    assert (x[:, :96].double() > 10).any() and (x[:, 96:].double().abs() > 10).any()
