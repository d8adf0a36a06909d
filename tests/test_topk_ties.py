"""The tie-tolerant top-k comparison helpers (tests/topk_ties.py): near-ties pass, real differences fail."""

import pytest
import torch

from tests.topk_ties import (
    assert_picks_agree,
    assert_scores_close,
    compare_picks,
    flip_against,
    flip_boundary,
    greedy_agreement,
    row_tolerance,
)

RTOL, ATOL = 1e-5, 1e-6


def _scores(rows: int = 6, n: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, n, generator=torch.Generator().manual_seed(seed))


def test_row_tolerance_ignores_infinities():
    s = torch.tensor([[1.0, -4.0, float("-inf")], [float("-inf")] * 3])
    assert torch.allclose(row_tolerance(s, 0.5, 0.25), torch.tensor([2.25, 0.25], dtype=torch.float64))


def test_identical_picks_in_any_order_agree():
    s = _scores()
    picks = s.topk(8).indices
    d = assert_picks_agree(s, picks, s, picks.flip(-1), rtol=RTOL, atol=ATOL, what="x")
    assert d.rows == 6 and d.near_tie_rows == [] and d.failures == []


def test_one_ulp_flip_of_a_near_tie_passes():
    s = _scores()
    s[2, 5], s[2, 7] = 2.5, 2.5 - 1e-6  # row 2: the 1st and 2nd scores 1e-6 apart
    got = s.clone()
    got[2], up, down, change = flip_boundary(s[2], 1)
    assert (up, down) == (7, 5) and 1e-6 <= change < 2e-6
    d = assert_picks_agree(s, s.topk(1).indices, got, got.topk(1).indices, rtol=RTOL, atol=ATOL, what="x")
    assert d.near_tie_rows == [2]


@pytest.mark.parametrize("swapped", [False, True])
def test_a_flip_against_the_other_sides_picks_disagrees_whichever_way_this_side_rounded(swapped):
    """The reference took entries {5, 9} of a row whose 2nd and 3rd scores are 1e-6 apart; this side's own
    rounding put them in the same order (swapped False) or the other way (True: this CPU already picks {5, 7}).
    A flip of this side's own boundary (`flip_boundary`) makes the sides agree in the swapped case; a flip
    against the reference's picks makes them disagree by a near-tie either way."""
    ref = _scores(1)[0]
    ref[5], ref[9], ref[7] = 3.0, 2.5, 2.5 - 1e-6
    ref_picks = ref.topk(2).indices
    mine = ref.clone()
    if swapped:
        mine[9], mine[7] = mine[7], mine[9]
    own, _, _, _ = flip_boundary(mine, 2)
    assert set(own.topk(2).indices.tolist()) == ({5, 9} if swapped else {5, 7})
    got, up, down, change = flip_against(mine, ref_picks)
    assert (up, down) == (7, 9) and abs(change) < 2e-6 and set(got.topk(2).indices.tolist()) == {5, 7}
    d = assert_picks_agree(ref, ref_picks, got, got.topk(2).indices, rtol=RTOL, atol=ATOL, what="x")
    assert d.near_tie_rows == [0]
    with pytest.raises(AssertionError, match="another entry scores between"):
        flip_against(torch.tensor([3.0, 2.0, 2.0 - 1e-6, 1.0]), torch.tensor([0, 3]))  # 1 and 2 lie between


def test_a_flip_beyond_the_tolerance_fails():
    s = _scores()
    s[2, 5], s[2, 7] = 2.5, 2.4  # 0.1 apart: no near-tie
    got = s.clone()
    got[2, 7] = 2.6
    d = compare_picks(s, s.topk(1).indices, got, got.topk(1).indices, rtol=RTOL, atol=ATOL)
    assert d.near_tie_rows == [] and len(d.failures) >= 1 and d.failures[0].startswith("row 2: entry")
    with pytest.raises(AssertionError, match="x: row 2"):
        assert_picks_agree(s, s.topk(1).indices, got, got.topk(1).indices, rtol=RTOL, atol=ATOL, what="x")


def test_picks_that_are_no_near_tie_on_the_other_side_fail():
    """Same scores on both sides, but one side took the 4th entry (2.0 below the boundary) instead of the 3rd."""
    s = torch.tensor([[5.0, 4.0, 3.0, 1.0, 0.0]])
    d = compare_picks(s, torch.tensor([[0, 1, 2]]), s, torch.tensor([[0, 1, 3]]), rtol=RTOL, atol=ATOL)
    assert d.near_tie_rows == [] and d.failures and all(f.startswith("row 0: entry") for f in d.failures)
    near = torch.tensor([[5.0, 4.0, 3.0, 3.0 - 1e-6, 0.0]])
    d = compare_picks(near, torch.tensor([[0, 1, 2]]), near, torch.tensor([[0, 1, 3]]), rtol=RTOL, atol=ATOL)
    assert d.near_tie_rows == [0] and d.failures == []


def test_valid_pick_counts_must_match_and_ties_at_minus_inf_pass():
    s = torch.tensor([[3.0, 2.0, float("-inf"), float("-inf")]])
    a, b = torch.tensor([[0, 1, 2]]), torch.tensor([[1, 0, 3]])  # top-3 had to take one of two -inf entries
    assert assert_picks_agree(s, a, s, b, rtol=RTOL, atol=ATOL, what="x").near_tie_rows == [0]
    d = compare_picks(s, a, s, torch.tensor([[1, 0, -1]]), rtol=RTOL, atol=ATOL)
    assert d.failures == ["row 0: 3 valid picks vs 2"]


def test_scores_close_checks_infinities_and_values():
    s = _scores(3, 8)
    s[1, 2] = float("-inf")
    near = s + 1e-7
    assert_scores_close(s, near, rtol=RTOL, atol=ATOL, what="x")
    far = s.clone()
    far[0, 3] += 1e-3
    with pytest.raises(AssertionError, match="x: score differs by 0.001 at row 0, entry 3"):
        assert_scores_close(s, far, rtol=RTOL, atol=ATOL, what="x")
    moved = s.clone()
    moved[1, 2], moved[1, 3] = 0.0, float("-inf")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_scores_close(s, moved, rtol=RTOL, atol=ATOL, what="x")


def test_greedy_agreement():
    lg = _scores(4, 10, seed=3)
    top = lg.argmax(-1).tolist()
    assert greedy_agreement(lg, top, rtol=RTOL, atol=ATOL) == (4, "")
    tied = lg.clone()
    row, _, _, _ = flip_boundary(lg[2], 1)  # step 2's runner-up one ulp above the top: either token is fine
    tied[2] = row
    assert greedy_agreement(tied, top[:2] + [lg[2].argmax().item()] + top[3:], rtol=RTOL, atol=ATOL) == (2, "near-tie")
    n, why = greedy_agreement(lg, top[:1] + [lg[1].argmin().item()] + top[2:], rtol=RTOL, atol=ATOL)
    assert n == 1 and why.startswith("step 1: token")
