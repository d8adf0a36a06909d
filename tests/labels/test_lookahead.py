import pytest
import torch

import flashmemory.labels.lookahead as la
from flashmemory.labels import LabelsCSR, LabelsError, lookahead_union, lookahead_union_all

from .brute import brute_union


def _random_rows(T, n_chunks, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(T):
        k = int(torch.randint(0, 6, (1,), generator=g))
        ids = torch.randperm(n_chunks, generator=g)[:k].tolist()
        rows.append([(j, int(torch.randint(1, 9, (1,), generator=g))) for j in ids])
    return rows


@pytest.mark.parametrize("tau", [1, 3, 64])
def test_union_matches_brute(tau, monkeypatch):
    monkeypatch.setattr(la, "_BLOCK_PAIRS", 50)  # force many small blocks
    rows = _random_rows(90, 40, seed=tau)
    csr = LabelsCSR.from_rows(rows)
    all_ = lookahead_union_all(csr, tau=tau).to_rows()
    for t in range(len(rows)):
        want = brute_union(rows, t, tau)
        assert all_[t] == want
        idx, best = lookahead_union(csr, t, tau)
        assert list(zip(idx.tolist(), best.tolist())) == want


def test_union_chunk_limit():
    rows = _random_rows(30, 40, seed=7)
    csr = LabelsCSR.from_rows(rows)
    lim = torch.randint(5, 40, (30,))
    got = lookahead_union_all(csr, tau=4, n_chunks=lim).to_rows()
    for t in range(30):
        assert got[t] == brute_union(rows, t, 4, int(lim[t]))
    assert lookahead_union_all(csr, tau=4, n_chunks=0).to_rows() == [[]] * 30
    idx, _ = lookahead_union(csr, 3, 4, n_chunks=10)
    assert idx.tolist() == [j for j, _ in brute_union(rows, 3, 4, 10)]


def test_union_edges():
    assert lookahead_union_all(LabelsCSR.empty(4)).to_rows() == [[], [], [], []]
    with pytest.raises(LabelsError, match="tau"):
        lookahead_union_all(LabelsCSR.empty(2), tau=0)
    with pytest.raises(IndexError):
        lookahead_union(LabelsCSR.empty(2), 2)
