"""95% intervals over documents: Wilson and the percentile bootstrap against hand-computed values, and the mean
rows that carry them (with the equal-budget mismatch)."""

import math

import pytest

from flashmemory.eval.harness import budget_cells, mean_rows
from flashmemory.eval.intervals import bootstrap_mean, interval, wilson


def test_wilson_hand_computed():
    # 0 of 3: lo 0, hi z^2 / (3 + z^2) = 3.841459 / 6.841459
    assert wilson(0, 3) == (0.0, pytest.approx(0.561497, abs=1e-6))
    assert wilson(3, 3) == (pytest.approx(1 - 0.561497, abs=1e-6), 1.0)
    # 1 of 2: centre 0.5, half-width z sqrt(1/8 + z^2/16) / (1 + z^2/2) = 1.959964 * 0.604228 / 2.920730
    assert wilson(1, 2) == (pytest.approx(0.094531, abs=1e-6), pytest.approx(0.905469, abs=1e-6))
    # 8 of 10: the textbook Wilson interval (0.4902, 0.9433)
    assert wilson(8, 10) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    assert all(math.isnan(v) for v in wilson(0, 0))
    with pytest.raises(ValueError, match="successes"):
        wilson(4, 3)


def test_bootstrap_hand_computed():
    # [0, 0, 0, 1]: a resample's mean is k/4, k ~ Binomial(4, 1/4): P(k=0) = 0.316 > 2.5%, so lo = 0;
    # P(k <= 2) = 0.949 < 97.5% <= P(k <= 3) = 0.996, so hi = 0.75
    assert bootstrap_mean([0, 0, 0, 1]) == (0.0, 0.75)
    assert bootstrap_mean([0.0, 1.0]) == (0.0, 1.0)  # P(mean 0) = P(mean 1) = 1/4
    assert bootstrap_mean([0.4]) == (0.4, 0.4) and bootstrap_mean([0.3] * 5) == (0.3, 0.3)
    assert all(math.isnan(v) for v in bootstrap_mean([]))
    assert bootstrap_mean([0.1, 0.5, 0.2, 0.9]) == bootstrap_mean([0.1, 0.5, 0.2, 0.9]), "seeded"
    lo, hi = bootstrap_mean([0.1, 0.5, 0.2, 0.9])
    assert 0.1 <= lo < 0.425 < hi <= 0.9


def test_interval_cells_skip_nan_and_refuse_inf():
    cell = interval([1.0, float("nan"), 0.0], "wilson")
    assert cell["n"] == 2 and cell["method"] == "wilson"
    assert (cell["lo"], cell["hi"]) == pytest.approx((0.094531, 0.905469), abs=1e-6)
    assert interval([0.0, 0.0, 0.0, 1.0], "bootstrap") == {"n": 4, "lo": 0.0, "hi": 0.75, "method": "bootstrap"}
    with pytest.raises(ValueError, match="infinite"):
        interval([0.5, float("inf")], "bootstrap")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        interval([1.5], "wilson")
    with pytest.raises(ValueError, match="unknown interval"):
        interval([0.5], "normal")


def _doc(score, mass, matched=True, pages=2.0, target=2.0):
    mon = {
        "task_score": score,
        "mass": mass,
        "kmax": 3,
        "resident_frac": 0.2,
        "mean_pages": pages,
        "target_pages": target,
        "budget_matched": matched,
        "miss_values": [0.1],
    }
    return {
        "FlashMemory": {"task_score": score, "mass": mass, "kmax": 3, "resident_frac": 0.2, "mean_pages": target},
        "FlashMemory+monitor": mon,
    }


def test_mean_rows_carry_intervals_and_the_budget_mismatch_with_both_means():
    docs = [_doc(1.0, 0.8), _doc(0.0, 0.6, False, 3.5, 3.0), _doc(1.0, 0.7, False, 2.5, 2.0)]
    rows = mean_rows(docs)
    fm, mon = rows["FlashMemory"], rows["FlashMemory+monitor"]
    assert fm["task_score_ci"]["n"] == 3 and (fm["task_score_ci"]["lo"], fm["task_score_ci"]["hi"]) == pytest.approx(
        wilson(2, 3)
    )
    assert fm["mass"] == pytest.approx(0.7) and fm["mass_ci"]["method"] == "bootstrap"
    assert "budget_unmatched" not in fm
    assert mon["budget_unmatched"] == {"docs": 2, "of": 3, "mean_pages": 3.0, "target_pages": 2.5}
    assert mon["miss_values"] == [0.1] * 3
    ok = mean_rows([_doc(1.0, 0.8)])["FlashMemory+monitor"]["budget_unmatched"]
    assert ok["docs"] == 0 and math.isnan(ok["mean_pages"])


def test_budget_cells_keep_the_old_keys_and_add_intervals():
    docs = [_doc(1.0, 0.8), _doc(0.0, 0.6, False, 3.5, 3.0), _doc(1.0, 0.7)]
    cells = budget_cells(docs, ["a", "a", "b"])
    assert cells["task:a"] == {"FlashMemory": 0.5, "FlashMemory+monitor": 0.5} and cells["task:b"]["FlashMemory"] == 1.0
    assert cells["task_ci:a"]["FlashMemory"]["n"] == 2 and cells["task_ci:b"]["FlashMemory"]["n"] == 1
    fm = cells["FlashMemory"]
    assert {"task_score", "mass", "resident_frac", "kmax", "task_score_ci", "mass_ci"} <= set(fm)
    assert cells["FlashMemory+monitor"]["budget_unmatched"]["docs"] == 1


def test_bootstrap_pooled_resamples_whole_documents():
    from flashmemory.eval.intervals import bootstrap_pooled

    # doc 0: 0 of 1 cycle, doc 1: 3 of 3: a resample is {0,0} (p 1/4) -> 0, {1,1} (1/4) -> 1, mixed -> 3/4
    assert bootstrap_pooled([0.0, 3.0], [1, 3]) == (0.0, 1.0)
    assert bootstrap_pooled([2.0, 1.0], [4, 2]) == (0.5, 0.5)
    with pytest.raises(ValueError, match="counts > 0"):
        bootstrap_pooled([1.0], [0])


def test_policy_eval_cells_carry_per_document_intervals():
    import torch

    from flashmemory.eval.evaluate import Acc, format_table

    acc = Acc()
    gold = torch.tensor([True, True, False, False])
    acc.add(torch.tensor([True, False, False, False]), gold, [0.2, 0.4])  # doc 0: recall 0.5, mass 0.2 + 0.4
    acc.add(torch.tensor([True, True, False, False]), gold, [])  # doc 0: recall 1.0
    acc.end_doc()
    acc.add(torch.tensor([False, False, True, True]), gold, [0.9])  # doc 1: recall 0.0, mass 0.9
    acc.end_doc()
    assert acc.doc_recall == [(1.5, 2), (0.0, 1)]
    assert acc.doc_mass == [(pytest.approx(0.6), 2), (0.9, 1)]
    r = acc.result()
    assert r["golden_recall"] == pytest.approx(0.5) and r["native_mass"] == pytest.approx(0.5)
    assert r["golden_recall_ci"]["n"] == 2 and r["native_mass_ci"]["n"] == 2
    # the extremes of a two-document resample: doc 1 twice (0.0) and doc 0 twice (0.75)
    assert (r["golden_recall_ci"]["lo"], r["golden_recall_ci"]["hi"]) == (0.0, 0.75)
    line = format_table({"0.1": {"flashmemory": r}}).splitlines()[-1]
    assert "0.500 [0.000, 0.750]" in line and line.split()[-2:] == ["2", "3"]
