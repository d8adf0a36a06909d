"""Zero-padding a DeepSeek-V4 head into a wider one without changing what the model computes: the pure math.

A head is laid out `[nope | rope]`, the rope part in interleaved pairs (2i, 2i+1) with pair i at frequency
theta^(-2i / rope_dim) (YaRN-ramped in the compressed layers). Padding nope n -> N and rope r -> R (R = k r, k a
whole number) puts

- nope channel i at i (the extra nope channels are zero);
- rope pair p at pair k p of the wider rope: theta^(-2 k p / (k r)) is the same frequency, so rotating the wide
  vector rotates the source channels exactly as before and leaves the zero pairs at zero.

Dot products of two padded vectors equal the source ones. What else changes with the width, and its cancellation:

- an RMSNorm over the padded vector takes the mean over N + R channels instead of n + r: the projection that
  feeds it is multiplied by g = 1 / `norm_scale` = sqrt((N + R) / (n + r)), which restores the source's mean
  square (eps included), and the norm's weights by 1 / g; a weightless one (the attention's q norm) then leaves
  q times g, which the attention's 1/sqrt(head) scale, smaller by the same g, cancels;
- the lightning indexer's 1/sqrt(index_head) score scale has no norm before it: its `weights_proj` is multiplied
  by sqrt(N + R) / sqrt(n + r) (`norm_scale` inverted);
- YaRN's ramp bounds are floor / ceil of a correction dimension proportional to the rope width, so they do not
  scale by k in general: `yarn_betas` picks beta_fast / beta_slow for the wide rope whose bounds are exactly k
  times the source's, which makes every source pair's frequency equal at its new pair (`yarn_inv_freq` checks).

Everything here is float64 or index math on CPU tensors; nothing reads a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadPad:
    """One head's source and padded widths. nope/rope: source; nope_to/rope_to: padded (rope_to a multiple of rope)."""

    nope: int
    rope: int
    nope_to: int
    rope_to: int

    def __post_init__(self) -> None:
        if min(self.nope, self.rope) < 0 or self.rope % 2 or self.rope_to % 2:
            raise ValueError(f"{self}: widths must be >= 0 and rope widths even")
        if self.nope_to < self.nope or self.rope_to < self.rope:
            raise ValueError(f"{self}: the padded head must be at least as wide as the source")
        if self.rope and self.rope_to % self.rope:
            raise ValueError(f"{self}: rope_to must be a whole multiple of rope (pair p goes to pair k p)")

    @property
    def src(self) -> int:
        return self.nope + self.rope

    @property
    def dst(self) -> int:
        return self.nope_to + self.rope_to

    @property
    def stride(self) -> int:
        """k: source rope pair p lands on padded pair k p."""
        return self.rope_to // self.rope if self.rope else 1

    def norm_scale(self) -> float:
        """sqrt(src / dst): what an RMSNorm's weights are multiplied by so the padded norm gives the source values."""
        return math.sqrt(self.src / self.dst)


def channel_map(h: HeadPad) -> torch.Tensor:
    """[h.src] int64: the padded channel of each source channel (nope i -> i, rope 2p + j -> nope_to + 2 k p + j)."""
    nope = torch.arange(h.nope)
    r = torch.arange(h.rope)
    rope = h.nope_to + 2 * h.stride * (r // 2) + r % 2
    return torch.cat([nope, rope])


def head_rows(h: HeadPad, n_heads: int, blocks: int = 1) -> torch.Tensor:
    """[blocks * n_heads * h.src] int64 padded positions of a [blocks * n_heads * src] axis laid out
    block-major then head-major (a q projection's rows: blocks 1; the CSA compressor's Ca | Cb: n_heads 1, blocks 2)."""
    cm = channel_map(h)
    idx = torch.arange(blocks * n_heads).unsqueeze(1) * h.dst + cm.unsqueeze(0)
    return idx.reshape(-1)


def scatter_axis(t: torch.Tensor, dim: int, positions: torch.Tensor, size: int) -> torch.Tensor:
    """`t` placed along `dim` at `positions` of a zero tensor whose `dim` has `size` entries (same dtype)."""
    shape = list(t.shape)
    if shape[dim] != positions.numel():
        raise ValueError(f"axis {dim} has {shape[dim]} entries, {positions.numel()} positions given")
    shape[dim] = size
    out = t.new_zeros(shape)
    out.index_copy_(dim, positions, t)
    return out


def yarn_bounds(dim: int, base: float, original_len: int, beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """(low, high) pair indices of YaRN's linear ramp, as transformers and sglang 0.5.23 both compute them
    (floor / ceil of the correction dimension, clamped to [0, dim - 1])."""

    def corr(rot: float) -> float:
        return dim * math.log(original_len / (rot * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)


def _beta_for(value: float, dim: int, base: float, original_len: int) -> float:
    """The rotation count whose correction dimension at `dim` is `value` (inverse of `yarn_bounds`' corr)."""
    return original_len / (2 * math.pi) * math.exp(-value * 2 * math.log(base) / dim)


def yarn_betas(
    rope: int, rope_to: int, base: float, original_len: int, beta_fast: float, beta_slow: float
) -> tuple[float, float]:
    """(beta_fast, beta_slow) for a rope of width rope_to whose ramp bounds are k = rope_to / rope times the
    source's: the middle (in correction dimension) of the interval of betas that floor / ceil to those bounds,
    so the choice is stable to rounding. Raises ValueError if no beta gives them (a bound clamped at 0 or dim-1)."""
    k = rope_to // rope
    low, high = yarn_bounds(rope, base, original_len, beta_fast, beta_slow)
    bf = _beta_for(k * low + 0.5, rope_to, base, original_len)
    bs = _beta_for(k * high - 0.5, rope_to, base, original_len)
    if yarn_bounds(rope_to, base, original_len, bf, bs) != (k * low, k * high):
        raise ValueError(f"no YaRN betas give bounds {(k * low, k * high)} at rope width {rope_to}")
    return bf, bs


def yarn_inv_freq(dim: int, base: float, factor: float, original_len: int, bf: float, bs: float) -> torch.Tensor:
    """[dim // 2] float64 per-pair frequency of DeepSeek-V4's compressed-layer YaRN rope (no mscale)."""
    i = torch.arange(dim // 2, dtype=torch.float64)
    freqs = 1.0 / base ** (2 * i / dim)
    low, high = yarn_bounds(dim, base, original_len, bf, bs)
    ramp = ((i - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)
