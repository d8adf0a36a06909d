"""Policy evaluation on a dump at equal resident budgets.

At every cycle start t (every `stride` decode steps, default tau) each policy picks a resident set
among the n_t existing chunks. Budgets: "fm@thr" is FlashMemory's own count at its threshold, given
to every policy at that step (matched budget); "f" in `fractions` gives ceil(f * n_t) chunks.
Metrics, averaged over cycles:
  golden recall   share of the window union [t, t+tau) (existing chunks) that is resident
  native mass     share of the native top-k softmax mass of steps s in [t, t+tau) on resident chunks;
                  chunks created after t count as resident (recency tail). With a stored native top-k
                  (`doc.native_topk`, every c4 layer) it averages the stored steps in [t, t+tau) x all
                  stored layers (softmax over each row's valid picks). Otherwise only steps with
                  dumped native logits contribute (the first 3 decode steps of the target layers), so
                  it covers the t = 0 cycle only. `mass_steps` says how many steps it averages
  resident frac   resident / n_t;  chunks = mean resident count;  pages = mean 64-chunk pages touched
Golden recall and native mass also carry a 95% interval over documents ("golden_recall_ci", "native_mass_ci":
{"n": documents, "lo", "hi", "method": "bootstrap"}): the bootstrap resamples whole documents and recomputes the
pooled mean over their cycles (`flashmemory.eval.intervals.bootstrap_pooled`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashmemory.eval.intervals import bootstrap_pooled
from flashmemory.eval.policies import n_at, oracle, random_policy, reactive, recency
from flashmemory.labels import lookahead_union

PAGE_CHUNKS = 64


@dataclass(frozen=True)
class EvalConfig:
    tau: int = 64
    stride: int = 0  # 0 = tau
    fractions: tuple[float, ...] = (0.1, 0.25, 0.5)
    threshold: float = 0.5
    native_topk: int = 512  # native top-k whose softmax mass is measured
    seed: int = 0


def stored_topk_mass(doc, t: int, mask_t: torch.Tensor, tau: int, topk: int) -> list[float]:
    """Per stored step s in [t, t+tau) (doc.native_topk_steps): the resident share of softmax over the
    valid stored picks (idx >= 0, at most the `topk` highest), averaged over all stored c4 layers with
    a valid pick at s. mask_t: [n_t] bool resident set at t; ids >= n_t count as resident.
    Returns one float per stored step that has any valid pick."""
    out = []
    steps = doc.native_topk_steps.long()
    rows = ((steps >= t) & (steps < t + tau)).nonzero().squeeze(1).tolist()
    n_t = mask_t.numel()
    for r in rows:
        vals = []
        for C in sorted(doc.native_topk):
            idx, val = doc.native_topk[C][0][r].long(), doc.native_topk[C][1][r].float()
            ok = idx >= 0
            idx, val = idx[ok], val[ok]
            if idx.numel() == 0:
                continue
            if idx.numel() > topk:
                val, j = torch.topk(val, topk)
                idx = idx[j]
            p = torch.softmax(val, 0)
            res = idx >= n_t
            res[~res] = mask_t[idx[~res]]
            vals.append(float(p[res].sum()))
        if vals:
            out.append(sum(vals) / len(vals))
    return out


def native_mass(doc, t: int, mask_t: torch.Tensor, tau: int, topk: int) -> list[float]:
    """Per available step s in [t, t+tau): resident share of the native top-k softmax mass. Uses the
    stored native top-k when the doc has one (`stored_topk_mass`); otherwise softmax(top-k of the
    dumped native logits), averaged over the dump's target layers. Chunks >= n_t count as resident."""
    if doc.native_topk:
        return stored_topk_mass(doc, t, mask_t, tau, topk)
    out = []
    for s in range(t, min(t + tau, doc.n_tokens)):
        vals = []
        for L in doc.target_layers:
            lg = doc.native_logits.get((L, s))
            if lg is None:
                continue
            v, idx = torch.topk(lg.float(), min(topk, lg.numel()))
            p = torch.softmax(v, 0)
            res = torch.ones(lg.numel(), dtype=torch.bool)
            res[: mask_t.numel()] = mask_t
            vals.append(float(p[res[idx]].sum()))
        if vals:
            out.append(sum(vals) / len(vals))
    return out


class Acc:
    """Running sums of one (budget, policy) cell over cycles, with per-document subtotals for the intervals."""

    def __init__(self):
        self.recall, self.frac, self.chunks, self.pages, self.mass, self.n = 0.0, 0.0, 0.0, 0.0, [], 0
        self.recall_rows = 0
        self.doc_recall: list[tuple[float, int]] = []  # per finished document: (recall sum, cycles with gold)
        self.doc_mass: list[tuple[float, int]] = []  # per finished document: (mass sum, mass steps)
        self._mark = (0.0, 0, 0)  # (recall, recall_rows, len(mass)) when the document began

    def add(self, mask: torch.Tensor, gold: torch.Tensor, mass: list[float]) -> None:
        n = mask.numel()
        if gold.any():
            self.recall += float((mask & gold).sum()) / float(gold.sum())
            self.recall_rows += 1
        self.frac += float(mask.sum()) / max(n, 1)
        self.chunks += float(mask.sum())
        self.pages += float(torch.unique(mask.nonzero().squeeze(1) // PAGE_CHUNKS).numel())
        self.mass.extend(mass)
        self.n += 1

    def end_doc(self) -> None:
        """Close the current document's subtotals (a document with no recall row / mass step adds none)."""
        r0, rows0, m0 = self._mark
        if self.recall_rows > rows0:
            self.doc_recall.append((self.recall - r0, self.recall_rows - rows0))
        if len(self.mass) > m0:
            self.doc_mass.append((sum(self.mass[m0:]), len(self.mass) - m0))
        self._mark = (self.recall, self.recall_rows, len(self.mass))

    def result(self) -> dict:
        nan = float("nan")

        def ci(per_doc: list[tuple[float, int]]) -> dict:
            lo, hi = bootstrap_pooled([s for s, _ in per_doc], [c for _, c in per_doc])
            return {"n": len(per_doc), "lo": lo, "hi": hi, "method": "bootstrap"}

        return {
            "golden_recall": self.recall / self.recall_rows if self.recall_rows else nan,
            "native_mass": sum(self.mass) / len(self.mass) if self.mass else nan,
            "mass_steps": len(self.mass),
            "resident_frac": self.frac / max(self.n, 1),
            "chunks": self.chunks / max(self.n, 1),
            "pages": self.pages / max(self.n, 1),
            "cycles": self.n,
            "golden_recall_ci": ci(self.doc_recall),
            "native_mass_ci": ci(self.doc_mass),
        }


def evaluate(docs: list, fm_scores, cfg: EvalConfig) -> dict:
    """docs: DumpDocs; fm_scores(doc, t) -> ensemble scores [n_t]. Returns {budget: {policy: metrics}}."""
    stride = cfg.stride or cfg.tau
    budgets = ["fm@thr"] + [f"{f:g}" for f in cfg.fractions]
    acc = {b: {} for b in budgets}
    for doc in docs:
        for t in range(0, doc.n_tokens, stride):
            n = n_at(doc, t)
            if n == 0:
                continue
            scores = fm_scores(doc, t)
            fm_thr = scores > cfg.threshold
            idx, _ = lookahead_union(doc.labels, t, cfg.tau, n)
            gold = torch.zeros(n, dtype=torch.bool)
            gold[idx.long()] = True
            for b in budgets:
                k = int(fm_thr.sum()) if b == "fm@thr" else math.ceil(float(b) * n)
                masks = {
                    "flashmemory": fm_thr if b == "fm@thr" else _top(scores, k),
                    "recency": recency(doc, t, k),
                    "random": random_policy(doc, t, k, cfg.seed),
                    "reactive": reactive(doc, t, k),
                    "oracle": oracle(doc, t, k, cfg.tau),
                }
                for name, m in masks.items():
                    acc[b].setdefault(name, Acc()).add(m, gold, native_mass(doc, t, m, cfg.tau, cfg.native_topk))
        for pol in acc.values():
            for a in pol.values():
                a.end_doc()
    # The unconstrained golden set, for reference: its size is what a perfect retriever keeps.
    out = {b: {p: a.result() for p, a in pol.items()} for b, pol in acc.items()}
    return out


def mass_note(docs: list) -> str:
    """Which native-mass source `evaluate` used for these docs, for the printed note."""
    with_topk = [d for d in docs if d.native_topk]
    parts = []
    if with_topk:
        n_steps = sum(int(d.native_topk_steps.numel()) for d in with_topk)
        n_layers = sorted({len(d.native_topk) for d in with_topk})
        parts.append(
            f"mass over {n_steps} stored steps x {'/'.join(map(str, n_layers))} layers (stored native "
            f"top-k of every c4 layer, {len(with_topk)} of {len(docs)} docs)"
        )
    if len(with_topk) < len(docs):
        parts.append(
            f"{len(docs) - len(with_topk)} doc(s) without stored top-k: mass over the dumped native logits "
            "of the target layers (first 3 decode steps, so the t=0 cycle only)"
        )
    return "; ".join(parts) + "; nan where none."


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    from flashmemory.eval.policies import top_budget

    return top_budget(scores, k)


def format_table(res: dict) -> str:
    """One line per (budget, policy); recall and mass with their 95% intervals over documents, n = documents."""
    head = (
        f"{'budget':>8} {'policy':>12} {'frac':>6} {'chunks':>7} {'pages':>6} {'recall [95% CI]':>21} "
        f"{'mass [95% CI]':>21} {'docs':>4} {'n':>4}"
    )
    lines = [head, "-" * len(head)]

    def cell(m: dict, key: str) -> str:
        c = m.get(f"{key}_ci") or {}
        lo, hi = c.get("lo", float("nan")), c.get("hi", float("nan"))
        return f"{m[key]:.3f} [{lo:.3f}, {hi:.3f}]" if not math.isnan(lo) else f"{m[key]:.3f}"

    for b, pol in res.items():
        for p, m in pol.items():
            docs = max((m.get(k) or {}).get("n", 0) for k in ("golden_recall_ci", "native_mass_ci"))
            lines.append(
                f"{b:>8} {p:>12} {m['resident_frac']:6.3f} {m['chunks']:7.1f} {m['pages']:6.2f} "
                f"{cell(m, 'golden_recall'):>21} {cell(m, 'native_mass'):>21} {docs:4d} {m['cycles']:4d}"
            )
    return "\n".join(lines)
