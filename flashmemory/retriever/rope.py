"""YaRN RoPE as DeepSeek-V4's compressed layers use it: interleaved pairs, no mscale.

Angles are computed on the fly in float64 from the position, so no [max_position, rope/2] table is
held (upstream keeps ~134 MB of complex64 per layer for it) and precision holds at 1M positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeConfig:
    """YaRN parameters of DeepSeek-V4's compressed (c4/c128) layers and its lightning indexer."""

    rope_dim: int = 64
    theta: float = 160000.0
    factor: float = 16.0
    original_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position: int = 1048576  # positions >= this are clamped to max_position - 1

    def __post_init__(self) -> None:
        if self.rope_dim < 2 or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and >= 2, got {self.rope_dim}")
        if self.max_position < 1:
            raise ValueError(f"max_position must be >= 1, got {self.max_position}")


def yarn_correction_range(cfg: RopeConfig) -> tuple[int, int]:
    """(low, high) frequency indices of the YaRN ramp; (15, 25) for DeepSeek-V4's indexer."""

    def corr(rot: float) -> float:
        return cfg.rope_dim * math.log(cfg.original_len / (rot * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low = max(math.floor(corr(cfg.beta_fast)), 0)
    high = min(math.ceil(corr(cfg.beta_slow)), cfg.rope_dim // 2 - 1)
    return low, high


def yarn_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """Per-pair angular frequency [rope_dim // 2] float64: base frequencies below `low`, divided by
    `factor` from `high` on, and linearly blended in between."""
    half = cfg.rope_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    freqs = 1.0 / cfg.theta ** (2 * i / cfg.rope_dim)
    if cfg.factor == 1.0:
        return freqs
    low, high = yarn_correction_range(cfg)
    ramp = ((i - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
    return freqs * (1 - ramp) + freqs / cfg.factor * ramp


def rope_angles(positions: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    """positions: [...] int -> angles [..., rope_dim // 2] float64, with positions clamped to the table."""
    pos = positions.to(torch.float64).clamp(0, cfg.max_position - 1)
    return pos.unsqueeze(-1) * yarn_inv_freq(cfg).to(pos.device)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    """Rotate the last `rope_dim` dims of x in interleaved pairs (2i, 2i+1); earlier dims pass through.

    x: [B, H, D] (or [B, D]); positions: [B] int. Returns a tensor of x's shape and dtype.
    """
    ang = rope_angles(positions, cfg)  # [B, rope/2]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)  # broadcast over heads
    cos, sin = ang.cos().to(torch.float32), ang.sin().to(torch.float32)
    nope, rot = x[..., : -cfg.rope_dim], x[..., -cfg.rope_dim :].float()
    pairs = rot.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, out.to(x.dtype)), dim=-1)
