"""Every residency method on one document at one page budget: replay (engine + Level 1), then Level-2 quality.

Shared by `flashmemory demo` and `flashmemory eval --decode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashmemory.eval.decode import DocRun, mass_covered, method_quality, resident_stats
from flashmemory.eval.intervals import interval
from flashmemory.eval.methods import EXTRA_METHODS, METHODS, DocView, make_method
from flashmemory.eval.monitored import METHOD as MONITORED
from flashmemory.eval.monitored import (
    MonitorEvalConfig,
    cap_pages,
    equal_budget_replay,
    mean_resident_pages,
    monitor_factory,
)
from flashmemory.eval.replay import replay_doc
from flashmemory.residency.policy import SelectionConfig


@dataclass(frozen=True)
class HarnessConfig:
    tau: int = 64  # Level-1 interval, decode steps
    page_chunks: int = 64  # chunks per page
    tail_chunks: int = 2048  # recency tail, chunks
    threshold: float = 0.5  # FlashMemory score threshold
    seed: int = 0  # random baseline
    methods: tuple[str, ...] = METHODS
    monitor: MonitorEvalConfig = MonitorEvalConfig()
    # How a request is attended before its first Level-1 plan (`replay.FIRST_PLANS`): "prompt" (a step-0 cycle on
    # the prompt's last position, what the published frontier models); "full" / "recency": the live server's copy /
    # shrink mode, the first plan seen first_plan_lag steps after the first decode step.
    first_plan: str = "prompt"
    first_plan_lag: int = 0

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS + EXTRA_METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS + EXTRA_METHODS)}")
        if self.tau < 1 or self.page_chunks < 1 or self.tail_chunks < 0:
            raise ValueError("tau and page_chunks must be >= 1, tail_chunks >= 0")


def kmax_for(run: DocRun, budget: float, page_chunks: int) -> int:
    """Pages a budget fraction allows on this document (at least one)."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must lie in (0, 1], got {budget}")
    return max(1, math.ceil(budget * math.ceil(run.index_chunks.shape[1] / page_chunks)))


def evaluate_doc(
    engine,
    run: DocRun,
    retriever,
    hc: HarnessConfig,
    targets: tuple[int, ...],
    budget: float,
    decode_text=None,
    quality: bool = True,
    residents: dict | None = None,
) -> dict[str, dict]:
    """{method: metrics} for Full and every method of `hc`. quality=False skips the Level-2 forwards
    (coverage and residency only), for budget sweeps. residents: if given, filled with each method's replayed
    resident sets (bool [T, N_c])."""
    n_total = run.index_chunks.shape[1]
    kmax = kmax_for(run, budget, hc.page_chunks)
    sel = SelectionConfig(threshold=hc.threshold, last_keep=hc.tail_chunks, page_chunks=hc.page_chunks, kmax=kmax)
    view = DocView(run.prompt_len, run.topk, run.labels, hc.tau)
    n_vis = torch.tensor([min((run.prompt_len + t + 1) // 4, n_total) for t in range(run.n_steps)])
    out: dict[str, dict] = {}
    fm_pages: float | None = None
    if quality:
        out["Full"] = method_quality(engine, run, None, n_vis, targets, decode_text) | {
            "recall_bytes": 0.0,
            "level1_share": 0.0,
            "kmax": kmax,
        }
    names = list(hc.methods)
    if MONITORED in names and "FlashMemory" in names:  # its budget is matched to FlashMemory's measured one
        names.remove(MONITORED)
        names.insert(names.index("FlashMemory") + 1, MONITORED)
    for name in names:

        def replay(k: int, monitor=None, cap: int | None = None, name=name, sel=sel):
            s2 = SelectionConfig(
                threshold=sel.threshold, last_keep=sel.last_keep, page_chunks=sel.page_chunks, kmax=max(k, cap or k)
            )
            return replay_doc(
                run.index_chunks,
                run.hidden,
                run.prompt_len,
                run.n_steps,
                lambda eng: make_method(name, view, s2, eng, retriever, seed=hc.seed),
                page_chunks=hc.page_chunks,
                kmax=k,
                tau=hc.tau,
                last_keep=hc.tail_chunks,
                target_layers=targets,
                monitor=monitor,
                page_cap=cap,
                first_plan=hc.first_plan,
                first_plan_lag=hc.first_plan_lag,
            )

        extra: dict = {}
        if name == MONITORED:
            cap = cap_pages(kmax, hc.monitor)
            if fm_pages is None:
                fm_pages = mean_resident_pages(replay(kmax).resident, hc.page_chunks)
            rep, extra = equal_budget_replay(
                replay,
                fm_pages,
                kmax,
                cap,
                hc.page_chunks,
                lambda base, c: monitor_factory(run.index_logits, targets, base, c, engine.index_topk, hc.monitor),
                max_base=max(1, math.ceil(fm_pages - 1e-9)) if hc.monitor.search_from_target else None,
            )
            miss = rep.metrics.get("miss_values", [])
            extra |= {
                "miss_mass_mean": sum(miss) / len(miss) if miss else float("nan"),
                "miss_values": miss,
                **{
                    k: float(rep.metrics.get(k, 0))
                    for k in ("escalations", "fallbacks", "fallback_cycles", "missing_pages_added", "monitor_cycles")
                },
            }
        else:
            rep = replay(kmax)
        pages = mean_resident_pages(rep.resident, hc.page_chunks)
        if name == "FlashMemory":
            fm_pages = pages
        m = {
            "recall_bytes": float(rep.metrics.get("recall_bytes", 0)),
            "kmax": kmax,
            "mean_pages": pages,
            "level1_share": rep.level1_s / max(rep.level1_s + run.n_steps * run.decode_step_s, 1e-12),
            **extra,
        }
        if quality:
            m |= method_quality(engine, run, rep.resident, rep.n_visible, targets, decode_text)
        else:
            m |= {"mass": mass_covered(run, rep.resident, engine.index_topk)}
            m |= resident_stats(
                rep.resident, rep.n_visible, run.index_chunks.shape[0], run.index_chunks.shape[2], len(targets)
            )
        out[name] = m
        if residents is not None:
            residents[name] = rep.resident
    return out


# The per-document rates printed with a 95% interval over documents (`flashmemory.eval.intervals`): Wilson for
# the task accuracy, the bootstrap for the rest. Each mean row gains "<key>_ci": {"n", "lo", "hi", "method"}.
RATE_INTERVALS = {
    "task_score": "wilson",
    "mass": "bootstrap",
    "golden_recall": "bootstrap",
    "agreement": "bootstrap",
    "resident_frac": "bootstrap",
    "bytes_vs_full": "bootstrap",
    "level1_share": "bootstrap",
    "miss_mass_mean": "bootstrap",
}


def mean_rows(per_doc: list[dict[str, dict]]) -> dict[str, dict]:
    """Average each method's metrics over documents (NaNs skipped; lists, e.g. miss-mass samples, concatenated).

    Additive fields: "<key>_ci" (a 95% interval with its n, for each key of RATE_INTERVALS present) and, for a
    method with an equal-budget search ("budget_matched" per document), "budget_unmatched": {"docs": documents
    whose search did not match, "of": documents searched, "mean_pages" / "target_pages": the method's and
    FlashMemory's mean resident pages averaged over the unmatched documents (nan when none)}."""
    out: dict[str, dict] = {}
    for name in per_doc[0]:
        out[name] = {}
        for k in per_doc[0][name]:
            if isinstance(per_doc[0][name][k], list):
                out[name][k] = [v for d in per_doc for v in d[name].get(k, [])]
                continue
            vals = [d[name][k] for d in per_doc if not (isinstance(d[name][k], float) and math.isnan(d[name][k]))]
            out[name][k] = sum(vals) / len(vals) if vals else float("nan")
        for k, how in RATE_INTERVALS.items():
            if k in per_doc[0][name]:
                out[name][f"{k}_ci"] = interval([d[name][k] for d in per_doc], how)
        if "budget_matched" in per_doc[0][name]:
            miss = [d[name] for d in per_doc if not d[name]["budget_matched"]]
            nan = float("nan")
            out[name]["budget_unmatched"] = {
                "docs": len(miss),
                "of": len(per_doc),
                "mean_pages": sum(m["mean_pages"] for m in miss) / len(miss) if miss else nan,
                "target_pages": sum(m["target_pages"] for m in miss) / len(miss) if miss else nan,
            }
    return out


def budget_cells(rows: list[dict[str, dict]], tasks: list[str]) -> dict[str, dict]:
    """One budget's entry of the demo's `task_by_budget`: per method the mean task score, top-k mass, resident
    fraction and KMAX with their intervals (and "budget_unmatched"); per task "task:<task>" -> {method: mean task
    score} and "task_ci:<task>" -> {method: its interval}. rows: one {method: metrics} per document; tasks: each
    document's task, in the same order."""
    extra = ("task_score_ci", "mass_ci", "resident_frac_ci", "budget_unmatched")
    out: dict[str, dict] = {
        name: {k: m.get(k) for k in ("task_score", "mass", "resident_frac", "kmax")}
        | {k: m[k] for k in extra if k in m}
        for name, m in mean_rows(rows).items()
    }
    for task in dict.fromkeys(tasks):
        sel = mean_rows([d for t, d in zip(tasks, rows) if t == task])
        out[f"task:{task}"] = {name: m.get("task_score") for name, m in sel.items()}
        out[f"task_ci:{task}"] = {name: m.get("task_score_ci") for name, m in sel.items()}
    return out
