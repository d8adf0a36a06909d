"""Every residency method on one document at one page budget: replay (engine + Level 1), then Level-2 quality.

Shared by `flashmemory demo` and `flashmemory eval --decode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashmemory.eval.decode import DocRun, mass_covered, method_quality, resident_stats
from flashmemory.eval.methods import METHODS, DocView, make_method
from flashmemory.eval.replay import replay_doc
from flashmemory.residency.policy import SelectionConfig


@dataclass(frozen=True)
class HarnessConfig:
    tau: int = 64            # Level-1 interval, decode steps
    page_chunks: int = 64    # chunks per page
    tail_chunks: int = 2048  # recency tail, chunks
    threshold: float = 0.5   # FlashMemory score threshold
    seed: int = 0            # random baseline
    methods: tuple[str, ...] = METHODS

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        if self.tau < 1 or self.page_chunks < 1 or self.tail_chunks < 0:
            raise ValueError("tau and page_chunks must be >= 1, tail_chunks >= 0")


def kmax_for(run: DocRun, budget: float, page_chunks: int) -> int:
    """Pages a budget fraction allows on this document (at least one)."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must lie in (0, 1], got {budget}")
    return max(1, math.ceil(budget * math.ceil(run.index_chunks.shape[1] / page_chunks)))


def evaluate_doc(engine, run: DocRun, retriever, hc: HarnessConfig, targets: tuple[int, ...], budget: float,
                 decode_text=None, quality: bool = True) -> dict[str, dict]:
    """{method: metrics} for Full and every method of `hc`. quality=False skips the Level-2 forwards
    (coverage and residency only), for budget sweeps."""
    n_total = run.index_chunks.shape[1]
    kmax = kmax_for(run, budget, hc.page_chunks)
    sel = SelectionConfig(threshold=hc.threshold, last_keep=hc.tail_chunks, page_chunks=hc.page_chunks, kmax=kmax)
    view = DocView(run.prompt_len, run.topk, run.labels, hc.tau)
    n_vis = torch.tensor([min((run.prompt_len + t + 1) // 4, n_total) for t in range(run.n_steps)])
    out: dict[str, dict] = {}
    if quality:
        out["Full"] = method_quality(engine, run, None, n_vis, targets, decode_text) | {
            "recall_bytes": 0.0, "level1_share": 0.0, "kmax": kmax}
    for name in hc.methods:
        rep = replay_doc(run.index_chunks, run.hidden, run.prompt_len, run.n_steps,
                         lambda eng, name=name: make_method(name, view, sel, eng, retriever, seed=hc.seed),
                         page_chunks=hc.page_chunks, kmax=kmax, tau=hc.tau, last_keep=hc.tail_chunks,
                         target_layers=targets)
        m = {"recall_bytes": float(rep.metrics.get("recall_bytes", 0)), "kmax": kmax,
             "level1_share": rep.level1_s / max(rep.level1_s + run.n_steps * run.decode_step_s, 1e-12)}
        if quality:
            m |= method_quality(engine, run, rep.resident, rep.n_visible, targets, decode_text)
        else:
            m |= {"mass": mass_covered(run, rep.resident, engine.index_topk)}
            m |= resident_stats(rep.resident, rep.n_visible, run.index_chunks.shape[0], run.index_chunks.shape[2],
                                len(targets))
        out[name] = m
    return out


def mean_rows(per_doc: list[dict[str, dict]]) -> dict[str, dict]:
    """Average each method's metrics over documents (NaNs skipped)."""
    out: dict[str, dict] = {}
    for name in per_doc[0]:
        out[name] = {}
        for k in per_doc[0][name]:
            vals = [d[name][k] for d in per_doc if not (isinstance(d[name][k], float) and math.isnan(d[name][k]))]
            out[name][k] = sum(vals) / len(vals) if vals else float("nan")
    return out
