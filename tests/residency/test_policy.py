"""Level-1 selection on hand-built cases, plus a brute-force cross-check on random ones."""

from __future__ import annotations

import pytest
import torch

from flashmemory.residency.policy import (
    PAGE_POLICIES,
    SelectionConfig,
    ThresholdPagePolicy,
    ensemble_scores,
    forced_mask,
    select_chunks,
    select_pages,
)

NO_FORCE = dict(last_keep=0, first_keep=0)
THR = dict(policy="threshold")  # the threshold-only page policy (the default "fill" spends the whole budget)


def kept(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask).flatten().tolist()


def rows(pages: torch.Tensor, counts: torch.Tensor) -> list[list[int]]:
    return [pages[b, : int(counts[b])].tolist() for b in range(pages.shape[0])]


def test_threshold_is_strict() -> None:
    s = torch.zeros(1, 10)
    s[0, 2] = 0.5  # equal: not kept
    s[0, 3] = torch.nextafter(torch.tensor(0.5), torch.tensor(1.0))  # just above: kept
    s[0, 4] = 0.9
    cfg = SelectionConfig(**NO_FORCE, **THR)
    assert kept(select_chunks(s, torch.tensor([10]), cfg)[0]) == [3, 4]
    s2 = torch.zeros(1, 128)
    s2[0, 70] = 0.5
    pages, counts = select_pages(s2, torch.tensor([128]), cfg)
    assert counts.tolist() == [0] and pages.tolist() == [[-1, -1]]
    s2[0, 70] = 0.51
    pages, counts = select_pages(s2, torch.tensor([128]), cfg)
    assert rows(pages, counts) == [[1]]


def test_max_vs_mean_ensemble() -> None:
    a = torch.tensor([[0.9, 0.9, 0.2, 0.55]])
    b = torch.tensor([[0.2, 0.0, 0.2, 0.55]])
    assert torch.equal(ensemble_scores([a, b], "or"), torch.tensor([[0.9, 0.9, 0.2, 0.55]]))
    assert torch.equal(ensemble_scores({10: a, 12: b}, "max"), ensemble_scores([a, b], "or"))
    torch.testing.assert_close(ensemble_scores([a, b], "mean"), torch.tensor([[0.55, 0.45, 0.2, 0.55]]))
    lengths = torch.tensor([4])
    or_keep = select_chunks(ensemble_scores([a, b], "or"), lengths, SelectionConfig(ensemble="or", **NO_FORCE))
    mean_keep = select_chunks(ensemble_scores([a, b], "mean"), lengths, SelectionConfig(ensemble="mean", **NO_FORCE))
    assert kept(or_keep[0]) == [0, 1, 3] and kept(mean_keep[0]) == [0, 3]
    with pytest.raises(ValueError, match="xor"):
        ensemble_scores([a], "xor")
    with pytest.raises(ValueError, match="at least one"):
        ensemble_scores([])
    with pytest.raises(ValueError, match="xor"):
        SelectionConfig(ensemble="xor")


def test_recency_tail_and_sink() -> None:
    s = torch.zeros(1, 400)
    lengths = torch.tensor([300])
    cfg = SelectionConfig(last_keep=10, first_keep=3, **THR)
    assert kept(select_chunks(s, lengths, cfg)[0]) == [0, 1, 2] + list(range(290, 300))
    assert kept(forced_mask(lengths, 400, cfg)[0]) == [0, 1, 2] + list(range(290, 300))
    assert rows(*select_pages(s, lengths, cfg)) == [[0, 4]]
    # A tail that crosses a page boundary (chunks 250..299) forces pages 3 and 4.
    assert rows(*select_pages(s, lengths, SelectionConfig(last_keep=50, first_keep=0, **THR))) == [[3, 4]]
    # A sink of 65 chunks spans two pages.
    assert rows(*select_pages(s, lengths, SelectionConfig(last_keep=0, first_keep=65, **THR))) == [[0, 1]]
    # A tail longer than the history keeps all of it, and nothing past it.
    assert kept(select_chunks(s, torch.tensor([5]), SelectionConfig(last_keep=2048))[0]) == [0, 1, 2, 3, 4]


def test_kmax_ranks_forced_then_count_then_recency() -> None:
    n = 64 * 8
    s = torch.zeros(1, n)
    for page, count in {1: 5, 2: 20, 3: 5, 5: 40, 6: 1}.items():
        s[0, page * 64 : page * 64 + count] = 0.9
    lengths = torch.tensor([n - 10])  # history ends inside page 7
    cfg = SelectionConfig(last_keep=4, first_keep=0, kmax=3)
    # Page 7 is forced (tail); then 40 (page 5), 20 (page 2).
    assert rows(*select_pages(s, lengths, cfg)) == [[2, 5, 7]]
    # Equal counts and equal scores (pages 1 and 3): the more recent page wins.
    assert rows(*select_pages(s, lengths, cfg, kmax=4)) == [[2, 3, 5, 7]]
    assert rows(*select_pages(s, lengths, cfg, kmax=5)) == [[1, 2, 3, 5, 7]]
    assert rows(*select_pages(s, lengths, cfg, kmax=6)) == [[1, 2, 3, 5, 6, 7]]
    # Forced pages beat any count even when they crowd out scored pages.
    pages, counts = select_pages(s, lengths, SelectionConfig(last_keep=4, first_keep=1, kmax=2))
    assert rows(pages, counts) == [[0, 7]] and pages.shape == (1, 2)


def test_max_resident_caps_chunks_and_pages() -> None:
    s = torch.zeros(1, 200)
    s[0, [10, 20, 30, 40]] = torch.tensor([0.6, 0.95, 0.7, 0.8])
    lengths = torch.tensor([200])
    cfg = SelectionConfig(last_keep=3, first_keep=0, max_resident=5)
    # 3 forced (197..199) + the best 2 passing (20: 0.95, 40: 0.8).
    assert kept(select_chunks(s, lengths, cfg)[0]) == [20, 40, 197, 198, 199]
    # Forced chunks alone exceed the cap: they are still all kept, nothing else is.
    assert kept(select_chunks(s, lengths, SelectionConfig(last_keep=6, max_resident=5))[0]) == list(range(194, 200))
    assert SelectionConfig(max_resident=200, kmax=96).page_cap == 3
    assert SelectionConfig(max_resident=10, kmax=96).page_cap == 1
    assert SelectionConfig(max_resident=0, kmax=7).page_cap == 7
    big = torch.zeros(1, 64 * 10)
    big[0, ::7] = 0.9  # every page has passing chunks
    pages, counts = select_pages(big, torch.tensor([640]), SelectionConfig(last_keep=0, max_resident=200))
    assert counts.tolist() == [3] and pages.shape == (1, 3)


def test_history_shorter_than_a_page_and_mixed_batch() -> None:
    n = 64 * 3
    s = torch.full((4, n), 0.9)  # every column passes, including those past each history
    lengths = torch.tensor([10, 130, 0, 64])
    cfg = SelectionConfig(last_keep=0, kmax=8)
    pages, counts = select_pages(s, lengths, cfg)
    assert rows(pages, counts) == [[0], [0, 1, 2], [], [0]]
    assert torch.all(pages[2] == -1) and counts.tolist() == [1, 3, 0, 1]
    chunks = select_chunks(s, lengths, cfg)
    assert chunks.sum(1).tolist() == [10, 130, 0, 64]
    # Tail-forced only: a 10-chunk history gives page 0; an empty history gives nothing.
    zero = torch.zeros(4, n)
    assert rows(*select_pages(zero, lengths, SelectionConfig(last_keep=16, **THR))) == [[0], [1, 2], [], [0]]
    # Filling: every page of each history, nothing past it.
    assert rows(*select_pages(zero, lengths, SelectionConfig(last_keep=16))) == [[0], [0, 1, 2], [], [0]]


def test_no_page_beyond_history_even_when_filling() -> None:
    s = torch.ones(2, 640)
    lengths = torch.tensor([100, 1])
    for policy in PAGE_POLICIES:
        for scores in (s, torch.zeros(2, 640)):
            pages, counts = select_pages(scores, lengths, SelectionConfig(last_keep=0, kmax=10, policy=policy))
            want = [[0, 1], [0]] if policy == "fill" or scores is s else [[], []]
            assert rows(pages, counts) == want, policy


def test_fill_spends_the_budget_on_the_best_scoring_pages() -> None:
    n = 64 * 8
    s = torch.full((1, n), 0.05)
    s[0, 64 * 2 + 3] = 0.8  # the only passing chunk: page 2
    s[0, 64 * 5 : 64 * 5 + 32] = 0.45  # below the threshold, but the largest summed score: page 5
    s[0, 64 * 0 : 64 * 0 + 16] = 0.4  # second largest: page 0
    lengths = torch.tensor([n - 3])  # history ends inside page 7, the tail's page
    thr = SelectionConfig(last_keep=2, kmax=4, **THR)
    fill = SelectionConfig(last_keep=2, kmax=4)
    assert rows(*select_pages(s, lengths, thr)) == [[2, 7]]
    # Tail and threshold pages first, then the pages by summed score until KMAX.
    assert rows(*select_pages(s, lengths, fill)) == [[0, 2, 5, 7]]
    assert rows(*select_pages(s, lengths, fill, kmax=3)) == [[2, 5, 7]]
    # A budget below tail + threshold pages keeps what the threshold policy keeps.
    assert rows(*select_pages(s, lengths, fill, kmax=2)) == rows(*select_pages(s, lengths, thr, kmax=2)) == [[2, 7]]
    # Enough budget: every page of the history, never more.
    pages, counts = select_pages(s, lengths, fill, kmax=20)
    assert rows(pages, counts) == [list(range(8))] and pages.shape == (1, 8)
    # Equal summed scores (pages 1, 3, 4, 6 hold only 0.05s): the more recent page, on every call.
    for _ in range(3):
        assert rows(*select_pages(s, lengths, fill, kmax=5)) == [[0, 2, 5, 6, 7]]
    with pytest.raises(ValueError, match="policy"):
        SelectionConfig(policy="mass")


def brute_pages(scores: torch.Tensor, n_hist: int, cfg: SelectionConfig, cap: int) -> list[int]:
    pc = cfg.page_chunks
    cand = []
    for p in range(-(-n_hist // pc)):
        cols = range(p * pc, min((p + 1) * pc, n_hist))
        count = sum(1 for j in cols if scores[j] > cfg.threshold)
        mass = sum(scores[j] for j in cols if scores[j] > cfg.threshold)
        forced = any((cfg.last_keep > 0 and j >= n_hist - cfg.last_keep) or j < cfg.first_keep for j in cols)
        rest = sum(max(scores[j], 0.0) for j in cols)
        if forced or count > 0 or cfg.policy == "fill":
            # Forced pages all tie above the scored ones (upstream: +inf), the more recent first; then
            # count, then summed passing score, then (pages without a passing chunk) summed score, then
            # the more recent page.
            cand.append((1, 0, 0.0, 0.0, p) if forced else (0, count, mass, rest if count == 0 else 0.0, p))
    cand.sort(reverse=True)
    return sorted(c[-1] for c in cand[:cap])


def test_select_pages_matches_brute_force_on_random_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        b, n = 3, int(torch.randint(1, 700, (1,), generator=g))
        s = torch.rand(b, n, generator=g) ** 3
        lengths = torch.randint(0, n + 1, (b,), generator=g)
        cfg = SelectionConfig(
            threshold=float(torch.rand(1, generator=g)) * 0.5,
            last_keep=int(torch.randint(0, 150, (1,), generator=g)),
            first_keep=int(torch.randint(0, 80, (1,), generator=g)),
            kmax=int(torch.randint(1, 8, (1,), generator=g)),
            policy=PAGE_POLICIES[trial % 2],
        )
        pages, counts = select_pages(s, lengths, cfg)
        for r in range(b):
            want = brute_pages(s[r].tolist(), int(lengths[r]), cfg, cfg.kmax)
            assert pages[r, : counts[r]].tolist() == want, (trial, r)
            assert torch.all(pages[r, counts[r] :] == -1)


def test_fill_keeps_the_threshold_set_and_grows_with_the_budget() -> None:
    """For any budget: fill keeps min(kmax, pages) pages, holds every page the threshold policy keeps, and a
    larger budget only adds pages."""
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        b, n = 2, int(torch.randint(1, 500, (1,), generator=g))
        s = torch.rand(b, n, generator=g) ** 2
        lengths = torch.randint(0, n + 1, (b,), generator=g)
        kw = dict(
            threshold=float(torch.rand(1, generator=g)),
            last_keep=int(torch.randint(0, 100, (1,), generator=g)),
            first_keep=int(torch.randint(0, 50, (1,), generator=g)),
            page_chunks=int(torch.randint(1, 70, (1,), generator=g)),
        )
        prev = [set() for _ in range(b)]
        for k in range(1, 12):
            fill = rows(*select_pages(s, lengths, SelectionConfig(**kw, kmax=k)))
            thr = rows(*select_pages(s, lengths, SelectionConfig(**kw, kmax=k, **THR)))
            for r in range(b):
                n_pages = -(-int(lengths[r]) // kw["page_chunks"])
                assert len(fill[r]) == min(k, n_pages)
                assert set(thr[r]) <= set(fill[r]) and prev[r] <= set(fill[r])
                prev[r] = set(fill[r])


def test_threshold_page_policy() -> None:
    s = torch.zeros(64 * 4)
    s[64 + 1] = 0.9
    policy = ThresholdPagePolicy(SelectionConfig(last_keep=2, kmax=96, **THR))
    assert policy(s, 64 * 3, budget_pages=8).tolist() == [1, 2]
    assert policy(s, 64 * 3, budget_pages=1).tolist() == [2]
    filled = ThresholdPagePolicy(SelectionConfig(last_keep=2, kmax=96))
    assert filled(s, 64 * 3, budget_pages=8).tolist() == [0, 1, 2]
    assert filled(s, 64 * 3, budget_pages=2).tolist() == [1, 2]
    assert SelectionConfig(max_resident=640, kmax=12).page_cap == 10


def test_equal_counts_rank_by_score_before_recency() -> None:
    """A threshold that passes every chunk must still rank pages by the retriever's scores."""
    s = torch.full((1, 64 * 4), 0.6)
    s[0, 64:128] = 0.95  # page 1 scores highest, page 3 is the most recent
    lengths = torch.tensor([64 * 4])
    pages, counts = select_pages(s, lengths, SelectionConfig(threshold=0.5, last_keep=0, kmax=1))
    assert rows(pages, counts) == [[1]]
    s[0, 64:128] = 0.6  # all equal again: recency decides
    assert rows(*select_pages(s, lengths, SelectionConfig(threshold=0.5, last_keep=0, kmax=1))) == [[3]]
