"""The demo report on a hand-made results dict: every printed rate carries n and a 95% interval, and every row
whose equal-budget search did not match is marked with both mean page counts."""

import re

from flashmemory.demo.report import method_table, report_markdown, task_tables
from flashmemory.eval.harness import budget_cells, mean_rows
from flashmemory.eval.intervals import wilson

CFG = {
    "model": "m",
    "n_train": 1,
    "n_val": 1,
    "n_test": 3,
    "doc_len": 64,
    "gen_tokens": 8,
    "target_layers": [1],
    "tau": 4,
    "page_chunks": 4,
    "budget": 0.2,
    "tail_chunks": 4,
}
RATES = {
    "mass": 0.8,
    "golden_recall": 0.5,
    "agreement": 0.9,
    "resident_frac": 0.2,
    "bytes_vs_full": 0.25,
    "level1_share": 0.1,
    "recall_bytes": 2048.0,
    "kmax": 2,
}


def _doc(score, mass, matched=True, pages=2.0, target=2.0):
    fm = dict(RATES, task_score=score, mass=mass, mean_pages=target)
    mon = dict(
        fm,
        mean_pages=pages,
        target_pages=target,
        budget_matched=matched,
        miss_values=[0.1],
        miss_mass_mean=0.1,
        escalations=0.0,
        fallbacks=0.0,
    )
    return {"Full": dict(RATES, task_score=1.0, mass=1.0), "FlashMemory": fm, "FlashMemory+monitor": mon}


def _results(docs):
    tasks = ["a", "a", "b"][: len(docs)]
    return {
        "config": CFG,
        "methods": mean_rows(docs),
        "task_by_budget": {"0.2": budget_cells(docs, tasks)},
        "monitor_tasks": {"a": mean_rows(docs[:2])},
        "stage_seconds": {"x": 1.0},
        "model_note": "",
    }


def _row(md: str, start: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(start))


def test_every_rate_cell_has_an_interval_and_n():
    md = report_markdown(_results([_doc(1.0, 0.8), _doc(0.0, 0.6), _doc(1.0, 0.7)]))
    row = _row(md, "| FlashMemory |")
    lo, hi = wilson(2, 3)
    assert row.startswith("| FlashMemory | 3 | 0.700 [") and f"0.67 [{lo:.2f}, {hi:.2f}]" in row, row
    cells = row.strip("|").split("|")[2:]
    # every column but recalled KiB is a rate with an interval; the equal-budget column is "-" for FlashMemory
    with_ci = [c for c in cells if re.search(r"\[\d\.\d+, \d\.\d+\]", c)]
    assert len(with_ci) == 7 and cells[-1].strip() == "-", cells
    assert "| FlashMemory+monitor | 3 |" in md and "matched |" in _row(md, "| FlashMemory+monitor |")
    assert "NOT matched" not in md and "Budget not matched" not in md
    assert "95% interval over documents" in md
    task = _row(md, "| FlashMemory | 3 | 0.667 [")  # the task-accuracy table
    assert task.count("[") == 2
    per_task = _row(md, "| a | 2 |")
    assert per_task.count("[") == 3, per_task
    mon = _row(md, "| a | FlashMemory+monitor | 2 |")
    assert mon.count("[") >= 5 and mon.endswith("| matched |"), mon


def test_unmatched_budget_rows_are_marked_with_both_means():
    docs = [_doc(1.0, 0.8), _doc(0.0, 0.6, False, 3.5, 3.0), _doc(1.0, 0.7, False, 2.5, 2.0)]
    res = _results(docs)
    md = report_markdown(res)
    assert "**NOT matched** on 2/3 docs: mean pages 3.00 vs FlashMemory 2.50" in _row(md, "| FlashMemory+monitor |")
    assert md.count("- **Budget not matched**: FlashMemory+monitor") == 1
    assert "mean resident pages are 3.00 against FlashMemory's 2.50" in md
    assert "NOT matched** on 1/2 docs: mean pages 3.50 vs FlashMemory 3.00" in _row(md, "| a | FlashMemory+monitor |")
    assert "Budget not matched (a)" in md
    tt = "\n".join(task_tables(res["task_by_budget"]))
    assert " †" in _row(tt, "| FlashMemory+monitor |") and " †" not in _row(tt, "| FlashMemory |")
    assert "† **Budget not matched at 20%**" in tt
    assert "NOT matched" not in method_table(mean_rows([_doc(1.0, 0.8)]))
