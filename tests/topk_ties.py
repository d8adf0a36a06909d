"""Tie-tolerant comparison of two computations that go through a top-k (or an argmax).

Two computations of the same scores that differ in the last bits (another kernel, another shape, another CPU's
vector width) may resolve a near-tied top-k the other way; every later value then differs by far more than the
bits that caused it. A sound comparison therefore either has both sides compute the same bits, or:

1. compares the scores before the top-k within a stated tolerance (`assert_scores_close`), and
2. accepts a pick that differs only where it is a near-tie: its score lies within that tolerance of the k-th
   (boundary) score on both sides (`assert_picks_agree`); all other picks must be equal as sets, and
3. compares what follows the top-k on the same picks (tests/pinned_topk.py substitutes one side's picks into the
   other forward), or only up to the first near-tied step (`assert_greedy_agree`).

Tolerance per row: `atol + rtol * max |finite score of the row|` (`row_tolerance`). Picks are int tensors
[..., k] whose entries are indices into the last dim of the scores [..., N]; -1 marks an invalid pick (padding,
future or non-resident entry) and is compared by count. Scores are compared in fp64 so the check adds no rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def row_tolerance(scores: Tensor, rtol: float, atol: float) -> Tensor:
    """[R] fp64: atol + rtol * max finite |score| of each row of `scores` [R, N] (atol alone for an all -inf row)."""
    s = scores.double()
    finite = torch.isfinite(s)
    scale = torch.where(finite, s.abs(), torch.zeros_like(s)).amax(dim=-1) if s.shape[-1] else s.new_zeros(s.shape[0])
    return atol + rtol * scale


def assert_scores_close(ref: Tensor, got: Tensor, *, rtol: float, atol: float, what: str) -> None:
    """Same shape, -inf / +inf / nan at the same places, finite entries within `row_tolerance` of `ref`'s rows."""
    assert ref.shape == got.shape, f"{what}: score shapes {tuple(ref.shape)} vs {tuple(got.shape)}"
    a, b = ref.reshape(-1, ref.shape[-1]).double(), got.reshape(-1, got.shape[-1]).double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    same_special = torch.equal(fa, fb) and torch.equal(a[~fa].nan_to_num(0.0), b[~fb].nan_to_num(0.0))
    assert same_special, f"{what}: non-finite scores at different places"
    tol = row_tolerance(a, rtol, atol).unsqueeze(-1)
    err = torch.where(fa, (a - b).abs() - tol, torch.full_like(a, -1.0))
    worst = int(err.argmax()) if err.numel() else 0
    assert err.numel() == 0 or float(err.max()) <= 0, (
        f"{what}: score differs by {float((a - b).abs().reshape(-1)[worst]):.3g} at row {worst // a.shape[-1]}, "
        f"entry {worst % a.shape[-1]} (tolerance {float(tol.reshape(-1)[worst // a.shape[-1]]):.3g})"
    )


@dataclass
class PickDiff:
    """The outcome of `compare_picks`: rows whose pick sets differ only by near-ties, and the failures."""

    rows: int = 0  # rows compared
    near_tie_rows: list[int] = field(default_factory=list)  # rows whose picks differ, each a near-tie
    failures: list[str] = field(default_factory=list)  # differences that are not near-ties


def _membership(picks: Tensor, n: int) -> Tensor:
    """picks [R, k] int (-1 invalid) -> bool [R, N]: entry j picked in row r."""
    out = torch.zeros(picks.shape[0], n + 1, dtype=torch.bool, device=picks.device)
    out.scatter_(1, torch.where(picks >= 0, picks, torch.full_like(picks, n)).long(), True)
    return out[:, :n]


def compare_picks(
    ref_scores: Tensor, ref_picks: Tensor, got_scores: Tensor, got_picks: Tensor, *, rtol: float, atol: float
) -> PickDiff:
    """Compare two top-k pick sets row by row; order within a row does not matter.

    ref_scores / got_scores [..., N] float: the scores each side took its top-k over (after its masks);
    ref_picks / got_picks [..., k] int, -1 invalid. A row passes when its valid picks are the same set, or
    when it has as many valid picks on both sides and every entry picked by one side only scores within the
    row tolerance of that side's boundary (its lowest picked score) on BOTH sides: a near-tie that the last
    bits may resolve either way. Two -inf scores count as tied.
    """
    n = ref_scores.shape[-1]
    rs, gs = ref_scores.reshape(-1, n).double(), got_scores.reshape(-1, n).double()
    rp, gp = ref_picks.reshape(rs.shape[0], -1), got_picks.reshape(gs.shape[0], -1)
    diff = PickDiff(rows=rs.shape[0])
    a, b = _membership(rp, n), _membership(gp, n)
    tol = row_tolerance(rs, rtol, atol)
    for r in torch.nonzero((a != b).any(dim=1)).flatten().tolist():
        if int(a[r].sum()) != int(b[r].sum()):
            diff.failures.append(f"row {r}: {int(a[r].sum())} valid picks vs {int(b[r].sum())}")
            continue
        ok = True
        for scores, mine in ((rs[r], a[r]), (gs[r], b[r])):
            boundary = scores[mine].min()
            for j in torch.nonzero(a[r] ^ b[r]).flatten().tolist():
                gap = 0.0 if scores[j] == boundary else float((scores[j] - boundary).abs())
                if not gap <= float(tol[r]):
                    ok = False
                    diff.failures.append(
                        f"row {r}: entry {j} picked by one side only, {gap:.3g} from the "
                        f"boundary score (tolerance {float(tol[r]):.3g}): not a near-tie"
                    )
        if ok:
            diff.near_tie_rows.append(r)
    return diff


def assert_picks_agree(
    ref_scores: Tensor, ref_picks: Tensor, got_scores: Tensor, got_picks: Tensor, *, rtol: float, atol: float, what: str
) -> PickDiff:
    """`compare_picks`, raising AssertionError (prefixed with `what`) on any difference that is not a near-tie."""
    diff = compare_picks(ref_scores, ref_picks, got_scores, got_picks, rtol=rtol, atol=atol)
    assert not diff.failures, f"{what}: " + "; ".join(diff.failures[:5])
    return diff


def greedy_agreement(ref_logits: Tensor, got_tokens: list[int], *, rtol: float, atol: float) -> tuple[int, str]:
    """How far a greedy token sequence agrees with teacher-forced reference logits.

    ref_logits [T, V]: the reference's logits at each step, teacher-forced on `got_tokens` [T];
    returns (n, why): the first n tokens are the reference argmax (n == T: all), and `why` is "" when every
    step agrees, "near-tie" when step n's token scores within `row_tolerance` of the reference maximum there
    (a divergence the last bits may cause, after which the two continuations are different prompts), or the
    failure text otherwise.
    """
    lg = ref_logits.double()
    tol = row_tolerance(lg, rtol, atol)
    for i, tok in enumerate(got_tokens):
        best = int(lg[i].argmax())
        if tok == best:
            continue
        gap = float(lg[i, best] - lg[i, tok])
        if gap <= float(tol[i]):
            return i, "near-tie"
        return i, (
            f"step {i}: token {tok} scores {gap:.3g} below the reference's top token {best} "
            f"(tolerance {float(tol[i]):.3g})"
        )
    return len(got_tokens), ""


def flip_boundary(row: Tensor, k: int) -> tuple[Tensor, int, int, float]:
    """A copy of `row` [N] (float; -inf entries are never picked) whose (k+1)-th highest score is raised to one
    ulp above the k-th highest, so a top-k picks the former instead of the latter: the smallest change that
    flips this row's top-k. Returns (new row, index now picked, index now dropped, size of the change)."""
    order = torch.sort(row, descending=True, stable=True).indices
    kth, nxt = int(order[k - 1]), int(order[k])
    assert torch.isfinite(row[nxt]), f"row has fewer than {k + 1} finite scores"
    out = row.clone()
    out[nxt] = torch.nextafter(row[kth], torch.tensor(float("inf"), dtype=row.dtype))
    return out, nxt, kth, float(out[nxt] - row[nxt])


def flip_against(row: Tensor, picks: Tensor) -> tuple[Tensor, int, int, float]:
    """A copy of `row` [N] (float; -inf entries are never picked) on which a top-k of `picks`' size picks the
    OTHER side's `picks` [k] (int, -1 ignored) but one: the picked entry scoring lowest on `row` loses to the
    unpicked entry scoring highest on it, raised (or lowered) to one ulp above it. The flip is built from the
    other side's picks, not from this row's own order: where a near-tie already resolves the other way on this
    row (another CPU's rounding), `flip_boundary` would undo the disagreement, this keeps it. Raises
    AssertionError when the row's own scores do not allow it (another entry in between). Returns (new row, index
    now picked, index now dropped, size of the change)."""
    valid = picks[picks >= 0].long()
    mine = torch.zeros(row.shape[0], dtype=torch.bool, device=row.device)
    mine[valid] = True
    inside = int(valid[row[valid].argmin()])
    others = torch.where(mine | ~torch.isfinite(row), torch.full_like(row, float("-inf")), row)
    outside = int(others.argmax())
    assert torch.isfinite(others[outside]), "row has no finite entry outside the picks"
    out = row.clone()
    out[outside] = torch.nextafter(row[inside], torch.tensor(float("inf"), dtype=row.dtype))
    want = (mine & (torch.arange(row.shape[0], device=row.device) != inside)).clone()
    want[outside] = True
    got = torch.zeros_like(mine)
    got[torch.topk(out, int(mine.sum())).indices] = True
    assert torch.equal(got, want), "another entry scores between the two flipped ones: no one-ulp flip here"
    return out, outside, inside, float(out[outside] - row[outside])
