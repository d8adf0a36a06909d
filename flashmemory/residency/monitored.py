"""`MissMonitor`: the miss monitor and the escalation controller inside a Level-1 cycle.

`Level1` (given a monitor) calls `cycle` for each due request before the policy runs:
  1. pick the rotated target layer, score the full history with its native indexer (`NativeScorer`);
  2. measure the miss mass against the resident set published now (the engine's lookup table);
  3. let the controller update the request's budget and fallback state;
  4. return the budget for the policy and the pages to add beside its picks.
`merge_selection` then joins the policy's pages with those extras under the budget (recency tail first, then
the monitor's missing pages, then fallback pages, then the policy's by score). Counters, the miss-mass histogram
and each request's budget go to the engine's metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from flashmemory.residency.escalation import EscalationController
from flashmemory.residency.monitor import MissReport, NativeScorer, miss_report, resident_mask, rotate_layer


def merge_selection(
    pages: Sequence[int], prio: Sequence[float], extra: Sequence[int], extra_prio: Sequence[float], budget: int
) -> tuple[list[int], list[float]]:
    """Union of the policy's pages and the extras (a page in both keeps its higher priority), the `budget`
    highest-priority ones (ties: the newer page), returned in ascending page order with their priorities."""
    best: dict[int, float] = {}
    for p, q in list(zip(pages, prio)) + list(zip(extra, extra_prio)):
        p = int(p)
        if p >= 0 and q > best.get(p, float("-inf")):
            best[p] = float(q)
    keep = sorted(best.items(), key=lambda x: (-x[1], -x[0]))[: max(0, budget)]
    keep.sort()
    return [p for p, _ in keep], [q for _, q in keep]


class MissMonitor:
    """The monitor for one engine. layers: the target c4 layers it rotates over (index-K on the device)."""

    def __init__(self, engine, native: NativeScorer, controller: EscalationController, layers: Sequence[int]):
        if not layers:
            raise ValueError("MissMonitor needs at least one target layer")
        bad = [l for l in layers if l not in engine.layout.target_layers]
        if bad:
            raise ValueError(
                f"monitor layers {bad} are not target layers {engine.layout.target_layers} "
                "(only their index-K is on the device for the full history)"
            )
        self.engine, self.native, self.ctl, self.layers = engine, native, controller, tuple(layers)

    def measure(
        self, row: int, gen: int, n_hist: int, hidden: Mapping[int, torch.Tensor], position: torch.Tensor
    ) -> MissReport | None:
        """Steps 1-2: the rotated layer's native miss report against the resident set now (None: no native
        logits this cycle)."""
        layer = rotate_layer(self.layers, self.ctl.cycle_index(row, gen))
        logits = self.native(row, layer, n_hist, hidden, position)
        if logits is None:
            return None
        logits = logits.reshape(-1)[:n_hist].float()
        if not bool(torch.isfinite(logits).any()) and n_hist > 0:
            raise ValueError(f"miss monitor: native logits of row {row}, layer {layer} have no finite value")
        res = resident_mask(self.engine, row, n_hist)
        return miss_report(
            logits.nan_to_num(nan=float("-inf")), res, self.ctl.cfg.topk, self.engine.layout.page_chunks, layer
        )

    def cycle(
        self, row: int, gen: int, n_hist: int, hidden: Mapping[int, torch.Tensor], position: torch.Tensor
    ) -> tuple[int, list[int], list[float]]:
        """Steps 1-4: (budget for the policy, extra pages, their priorities)."""
        rep = self.measure(row, gen, n_hist, hidden, position)
        if rep is None:
            extra, prio = self.ctl.extra_pages(row, gen)
            return self.ctl.budget(row, gen), extra, prio
        dec = self.ctl.observe(row, gen, rep)
        extra, prio = self.ctl.extra_pages(row, gen)
        counts = dict(dec.events)
        if rep.miss_mass > self.ctl.cfg.threshold:
            counts["missing_pages_added"] = counts.get("missing_pages_added", 0) + min(
                len(rep.missing_pages), dec.budget
            )
        self.engine.record(
            row,
            gen,
            counts,
            {"budget_pages": dec.budget, "fallback": int(dec.fallback), "miss_mass_last": rep.miss_mass},
            miss=rep.miss_mass,
        )
        return dec.budget, extra, prio

    def sync(self, live: Mapping[int, int]) -> None:
        self.ctl.sync(live)
