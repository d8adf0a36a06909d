"""Normalized Sylvester Walsh-Hadamard transform, as DeepSeek-V4 applies it to index keys and queries."""

from __future__ import annotations

import torch


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of `x` by H_D / sqrt(D), H_D the Sylvester (natural-order) Hadamard matrix.

    x: [..., D] floating, D a power of two. Returns a new tensor of the same shape and dtype.
    The butterfly costs D log D per vector instead of the D^2 of a matmul; it is its own inverse.
    """
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_transform needs a power-of-two last dim, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        # Pairs (i, i+h) inside blocks of 2h become (a+b, a-b): one Sylvester doubling step.
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, d) * d**-0.5).to(x.dtype)


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The explicit Sylvester Hadamard matrix H_d (entries +-1, unnormalized), for tests and references."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_matrix needs a power of two, got {d}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h
