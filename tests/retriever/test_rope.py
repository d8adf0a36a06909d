"""YaRN RoPE: correction range, angles against a float64 computation, interleaved rotation."""

from __future__ import annotations

import math

import pytest
import torch

from flashmemory.retriever.rope import RopeConfig, apply_rope, rope_angles, yarn_correction_range, yarn_inv_freq


def ref_angle(pos: int, i: int, rope_dim=64, theta=160000.0, factor=16.0, orig=65536, low=15, high=25) -> float:
    f = 1.0 / theta ** (2 * i / rope_dim)
    r = 0.0 if i < low else 1.0 if i >= high else (i - low) / (high - low)
    return pos * (f * (1 - r) + f / factor * r)


def test_correction_range_is_15_25_for_deepseek_v4() -> None:
    corr = lambda r: 64 * math.log(65536 / (r * 2 * math.pi)) / (2 * math.log(160000))  # noqa: E731
    assert (math.floor(corr(32)), math.ceil(corr(1))) == (15, 25)
    assert yarn_correction_range(RopeConfig()) == (15, 25)
    # Other parameters move it: a sanity check that the function reads its config.
    assert yarn_correction_range(RopeConfig(original_len=4096)) != (15, 25)


@pytest.mark.parametrize("pos", [0, 1, 65535, 1048575])
def test_angles_match_float64(pos: int) -> None:
    got = rope_angles(torch.tensor([pos]), RopeConfig())[0]
    assert got.dtype == torch.float64 and got.shape == (32,)
    want = torch.tensor([ref_angle(pos, i) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_inv_freq_endpoints_and_clamp() -> None:
    f = yarn_inv_freq(RopeConfig())
    assert f[0].item() == 1.0  # below `low`: the base frequency
    assert f[31].item() == pytest.approx(160000.0 ** (-62 / 64) / 16, rel=1e-14)  # past `high`: divided by factor
    assert torch.all(f[1:] < f[:-1])
    cfg = RopeConfig(max_position=1000)
    torch.testing.assert_close(rope_angles(torch.tensor([5000, 999]), cfg)[0], rope_angles(torch.tensor([999]), cfg)[0])
    assert torch.equal(
        yarn_inv_freq(RopeConfig(factor=1.0)), 1.0 / 160000.0 ** (2 * torch.arange(32, dtype=torch.float64) / 64)
    )


def test_apply_rope_is_interleaved_complex_rotation_of_the_tail() -> None:
    cfg = RopeConfig(rope_dim=8)
    x = torch.randn(3, 2, 12)
    pos = torch.tensor([0, 7, 100000])
    out = apply_rope(x, pos, cfg)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out[..., :4], x[..., :4])  # the first head_dim - rope_dim dims pass through
    ang = torch.tensor(
        [
            [
                ref_angle(int(p), i, rope_dim=8, low=yarn_correction_range(cfg)[0], high=yarn_correction_range(cfg)[1])
                for i in range(4)
            ]
            for p in pos
        ]
    )
    z = torch.view_as_complex(x[..., 4:].double().reshape(3, 2, 4, 2).contiguous())
    want = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None, :]).reshape(3, 2, 8)
    torch.testing.assert_close(out[..., 4:].double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(apply_rope(x[:1], torch.tensor([0]), cfg), x[:1])  # position 0 is the identity
    # Rotation keeps the norm of every pair.
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="rope_dim"):
        RopeConfig(rope_dim=7)
    with pytest.raises(ValueError, match="max_position"):
        RopeConfig(max_position=0)
