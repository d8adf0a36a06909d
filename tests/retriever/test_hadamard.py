"""Normalized Sylvester Hadamard: orthogonal, equal to the explicit matrix, its own inverse."""

from __future__ import annotations

import math

import pytest
import torch

from flashmemory.retriever.hadamard import hadamard_matrix, hadamard_transform


def kron_sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(int(math.log2(d))):
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h


@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 64, 128])
def test_matrix_is_sylvester_and_orthogonal(d: int) -> None:
    h = hadamard_matrix(d)
    assert torch.equal(h, kron_sylvester(d))
    hn = h / math.sqrt(d)
    torch.testing.assert_close(hn @ hn.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)
    # Natural order: entry (i, j) is (-1)^popcount(i & j).
    i, j = torch.meshgrid(torch.arange(d), torch.arange(d), indexing="ij")
    pop = torch.tensor([[bin(a & b).count("1") for b in range(d)] for a in range(d)])
    assert torch.equal(h, (1 - 2 * (pop % 2)).double())
    del i, j


@pytest.mark.parametrize("d", [2, 16, 128])
def test_transform_equals_explicit_matrix(d: int) -> None:
    x = torch.randn(3, 5, d, dtype=torch.float64)
    want = x @ kron_sylvester(d) / math.sqrt(d)
    got = hadamard_transform(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hadamard_transform(got), x, rtol=1e-12, atol=1e-12)  # an involution
    x32 = x.float()
    out32 = hadamard_transform(x32)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want, rtol=1e-5, atol=1e-5)


def test_rejects_non_power_of_two() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_transform(torch.randn(4, 96))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
