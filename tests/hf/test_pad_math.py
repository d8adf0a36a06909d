"""Padding rules: channel placement, YaRN betas that keep every source frequency, the norm scale."""

from __future__ import annotations

import math

import pytest
import torch

from flashmemory.hf.pad_math import (
    HeadPad,
    channel_map,
    head_rows,
    scatter_axis,
    yarn_betas,
    yarn_bounds,
    yarn_inv_freq,
)

ATTN = HeadPad(96, 32, 448, 64)  # the shipped model's head -> sglang's
THETA, ORIG, FACTOR = 160000.0, 65536, 16.0


def test_channel_map_keeps_nope_and_puts_rope_pair_p_at_pair_2p() -> None:
    cm = channel_map(ATTN)
    assert cm[:96].tolist() == list(range(96))
    assert cm[96:100].tolist() == [448, 449, 452, 453]  # pairs 0, 1 -> padded pairs 0, 2
    assert cm[-2:].tolist() == [448 + 60, 448 + 61]  # pair 15 -> pair 30
    assert len(set(cm.tolist())) == 128


def test_head_rows_repeat_the_map_per_head_and_block() -> None:
    rows = head_rows(ATTN, n_heads=2, blocks=2)
    assert rows.numel() == 4 * 128
    assert rows[128:].view(3, 128).sub(channel_map(ATTN)).tolist() == [[512] * 128, [1024] * 128, [1536] * 128]


def test_scatter_axis_zero_fills_and_refuses_a_wrong_count() -> None:
    t = torch.arange(6.0).view(2, 3)
    out = scatter_axis(t, 1, torch.tensor([0, 2, 4]), 5)
    assert out.tolist() == [[0, 0, 1, 0, 2], [3, 0, 4, 0, 5]]
    with pytest.raises(ValueError, match="axis 1 has 3 entries"):
        scatter_axis(t, 1, torch.tensor([0, 1]), 5)


def test_padded_dot_products_and_norms_match() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 128, generator=g, dtype=torch.float64)
    pa, pb = (scatter_axis(x, 0, channel_map(ATTN), 512) for x in (a, b))
    assert torch.allclose(pa @ pb, a @ b)
    rms = lambda x: x.pow(2).mean().sqrt()  # noqa: E731
    assert torch.allclose(rms(pa) / ATTN.norm_scale(), rms(a))


def test_yarn_betas_make_every_source_frequency_exact_at_its_new_pair() -> None:
    bf, bs = yarn_betas(32, 64, THETA, ORIG, 32.0, 1.0)
    assert (round(bf, 3), round(bs, 4)) == (45.728, 0.7435)  # the values the study found by hand
    assert yarn_bounds(32, THETA, ORIG, 32, 1) == (7, 13) and yarn_bounds(64, THETA, ORIG, bf, bs) == (14, 26)
    src = yarn_inv_freq(32, THETA, FACTOR, ORIG, 32.0, 1.0)
    dst = yarn_inv_freq(64, THETA, FACTOR, ORIG, bf, bs)
    assert torch.allclose(dst[::2], src, rtol=1e-14, atol=0)
    naive = yarn_inv_freq(64, THETA, FACTOR, ORIG, 32.0, 1.0)  # keeping the source's betas moves the ramp
    assert not torch.allclose(naive[::2], src, rtol=1e-3)


def test_head_pad_refuses_a_rope_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match="whole multiple"):
        HeadPad(96, 24, 448, 64)
    with pytest.raises(ValueError, match="at least as wide"):
        HeadPad(500, 32, 448, 64)
    assert math.isclose(ATTN.norm_scale(), 0.5)
