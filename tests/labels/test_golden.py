import math

import pytest
import torch

from flashmemory.labels import LabelsError, golden_labels, layer_nucleus

from .brute import assert_rows_agree, brute_golden, brute_margins


def _masked_logits(n_layers, positions, n_total, scale, seed):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(n_layers, len(positions), n_total, generator=g) * scale
    vis = (torch.as_tensor(positions) + 1) // 4
    return lg.masked_fill(torch.arange(n_total)[None, None, :] >= vis[None, :, None], float("-inf"))


@pytest.mark.parametrize(
    "topk,topp,min_layers,scale", [(8, 0.6, 3, 2.0), (16, 0.3, 2, 4.0), (5, 0.9, 1, 0.5), (64, 0.6, 4, 3.0)]
)
def test_matches_brute_force(topk, topp, min_layers, scale):
    positions = list(range(0, 70))  # early rows see 0..few chunks: exercises k = min(k, visible) and empty rows
    lg = _masked_logits(6, positions, 18, scale, seed=topk)
    got = golden_labels(lg, topk=topk, topp=topp, min_layers=min_layers)
    want = brute_golden(list(lg), topk, topp, min_layers)
    # Two implementations of softmax / cumsum over the same logits: rows may differ only at a near-tie.
    margins = brute_margins(list(lg), topk, topp)
    assert_rows_agree(got.to_rows(), want, margins)
    assert sum(m <= 1e-5 for m in margins) <= 2  # near-tied rows are rare: the comparison still bites
    assert sum(len(r) for r in want) > 0
    assert got.to_rows()[0] == []  # position 0 sees no chunk


def test_label_comparison_accepts_a_near_tie_only():
    """A row whose cumulative mass sits one ulp from topp may differ; a row far from every boundary may not."""
    lg = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    p = torch.softmax(lg[0, 0].double(), 0)
    tie_topp = float(p[0] + p[1])  # the 2nd entry's cumulative mass is exactly topp
    tie = brute_margins(list(lg), 4, math.nextafter(tie_topp, 1.0))
    assert tie[0] <= 1e-5
    assert_rows_agree([[(0, 1)]], [[(0, 1), (1, 1)]], tie)
    far = brute_margins(list(lg), 4, 0.5)
    assert far[0] > 1e-2
    with pytest.raises(AssertionError, match="not near-ties"):
        assert_rows_agree([[(0, 1)]], [[(0, 1), (1, 1)]], far)


def test_n_visible_equals_inf_masking():
    lg = torch.randn(3, 20, 12)
    nv = torch.randint(0, 13, (20,))
    masked = lg.masked_fill(torch.arange(12)[None, None, :] >= nv[None, :, None], float("-inf"))
    a = golden_labels(list(lg), topk=6, topp=0.5, min_layers=2, n_visible=nv)
    b = golden_labels(masked, topk=6, topp=0.5, min_layers=2)
    assert a.to_rows() == b.to_rows()


def test_nucleus_edges():
    row = torch.tensor([[3.0, 1.0, 2.0, float("-inf"), 0.0]])
    idx, keep = layer_nucleus(row, topk=4, topp=0.0)
    assert idx[0, :4].tolist() == [0, 2, 1, 4] and keep[0].tolist() == [True, False, False, False]
    idx, keep = layer_nucleus(row, topk=10, topp=1.0)  # k capped at N; the invisible entry never kept
    assert idx.shape == (1, 5) and sorted(idx[0][keep[0]].tolist()) == [0, 1, 2, 4]
    p = torch.softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), 0)
    topp = float(p[0]) + 1e-4  # just past the first: keeps the first and the crossing second
    _, keep = layer_nucleus(row, topk=4, topp=topp)
    assert keep[0].tolist()[:3] == [True, True, False]
    _, keep = layer_nucleus(torch.full((2, 4), float("-inf")), topk=3, topp=0.6)
    assert not keep.any()


def test_votes_order_and_threshold():
    # Three layers agreeing on chunk 2, two on chunk 0: min_layers=2 keeps both, 2 first.
    big = 50.0
    l1 = torch.tensor([[big, 0, big + 1, 0]])
    l2 = torch.tensor([[big, 0, big + 1, 0]])
    l3 = torch.tensor([[0, 0, big, 0]])
    out = golden_labels([l1, l2, l3], topk=4, topp=0.99, min_layers=2)
    assert out.to_rows() == [[(2, 3), (0, 2)]]
    assert out.indices.dtype == out.scores.dtype == out.pointers.dtype == torch.int32


def test_bad_inputs():
    with pytest.raises(LabelsError, match="topp"):
        golden_labels([torch.zeros(2, 3)], topp=1.5)
    with pytest.raises(LabelsError, match="layer 1"):
        golden_labels([torch.zeros(2, 3), torch.zeros(3, 3)])
    with pytest.raises(LabelsError, match="min_layers"):
        golden_labels([torch.zeros(2, 3)], min_layers=0)
    assert math.isclose(0.6, 0.6)
