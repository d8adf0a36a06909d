"""FlashMemory+monitor in the CPU replay, at an equal average budget with FlashMemory.

The monitored method is FlashMemory (same retriever, threshold policy, tail and tau) plus the miss monitor and
escalation (`flashmemory.residency.monitored`). Its native scorer reads the Full run's captured native indexer
logits of the rotated target layer at the cycle's query position: exactly what serving computes from the
target layer's device index-K (`monitor.keys_native_scorer`).

Equal average budget. Escalation widens a request's budget when it misses, so at the same base KMAX the
monitored method would hold more pages. We equalize the measured average: the monitored method runs with the
largest base budget b <= KMAX (and, for that b, the largest cap c among 2 x KMAX, 1.5 x KMAX, KMAX + 1, KMAX)
whose mean resident pages over the decode steps (recalled + decode region, read from the engine's lookup table)
do not exceed FlashMemory's at KMAX. (b, c) is found by replaying candidates in that order (replays are cheap:
Level 1 and the engine, no model forward). If none fits, the last candidate is used and `budget_matched` is
False in the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from flashmemory.residency.escalation import EscalationConfig, EscalationController
from flashmemory.residency.monitor import NativeScorer
from flashmemory.residency.monitored import MissMonitor

METHOD = "FlashMemory+monitor"


@dataclass(frozen=True)
class MonitorEvalConfig:
    threshold: float = 0.2  # miss mass that escalates (the SGLANG_RETRIEVER_MISS_THRESHOLD default)
    low_threshold: float = 0.05
    cap_factor: float = 2.0  # cap = ceil(cap_factor * KMAX) pages
    shrink_after: int = 1  # short replays have few cycles: react within one
    fallback_after: int = 2
    # Start the equal-budget search at ceil(FlashMemory's mean pages) instead of KMAX: the same match without the
    # descent through every base above it (at large budgets FlashMemory's threshold keeps far fewer than KMAX pages)
    search_from_target: bool = False


def captured_native_scorer(index_logits: Mapping[int, torch.Tensor], first_position: int = 0) -> NativeScorer:
    """Native logits of c4 layer `layer` at query position `position` over the first n_hist chunks.
    index_logits: c4 id -> fp32 [S, N_c] (-inf where not visible), from `eval.decode.full_run`.
    first_position: the first decode position P. A query before it was computed by the prefill, which attended
    the full history: no decode step has attended a resident set yet, so the scorer returns None and the
    monitor takes no reading (measuring then would compare the native top-k with the empty set the replay
    admits: a miss mass of 1.0 by construction)."""

    def score(row: int, layer: int, n_hist: int, hidden, position: torch.Tensor) -> torch.Tensor | None:
        if int(position) < first_position:
            return None
        lg = index_logits[layer]
        pos = min(max(int(position), 0), lg.shape[0] - 1)
        out = torch.full((n_hist,), float("-inf"))
        m = min(n_hist, lg.shape[1])
        out[:m] = lg[pos, :m].float()
        return out

    return score


def monitor_factory(
    index_logits: Mapping[int, torch.Tensor],
    layers: tuple[int, ...],
    base: int,
    cap: int,
    topk: int,
    mc: MonitorEvalConfig,
) -> Callable:
    """(engine, first decode position P) -> MissMonitor with base budget `base` and cap `cap` (one request: the
    shared pool is cap - base); no reading before position P (`captured_native_scorer`)."""
    cfg = EscalationConfig(
        threshold=mc.threshold,
        low_threshold=mc.low_threshold,
        base=base,
        cap=cap,
        step=max(1, -(-(cap - base) // 2)),
        shrink_after=mc.shrink_after,
        fallback_after=mc.fallback_after,
        extra_pool=cap - base,
        topk=topk,
        fallback_history=len(layers),
    )

    def make(engine, first_position: int) -> MissMonitor:
        return MissMonitor(
            engine, captured_native_scorer(index_logits, first_position), EscalationController(cfg), layers
        )

    return make


def mean_resident_pages(resident: torch.Tensor, page_chunks: int) -> float:
    """Mean over decode steps of pages holding a resident chunk. resident: bool [T, N_c]."""
    t, n = resident.shape
    pad = (-n) % page_chunks
    pages = torch.nn.functional.pad(resident, (0, pad)).view(t, -1, page_chunks).any(-1)
    return float(pages.sum(1).float().mean())


def cap_pages(kmax: int, mc: MonitorEvalConfig) -> int:
    """The monitored method's per-request cap: ceil(cap_factor x KMAX) pages, at least KMAX."""
    return max(kmax, math.ceil(mc.cap_factor * kmax - 1e-9))


def equal_budget_replay(
    replay: Callable[[int, Callable | None, int], object],
    target_pages: float,
    kmax: int,
    cap: int,
    page_chunks: int,
    make_monitor: Callable[[int, int], Callable],
    max_base: int | None = None,
) -> tuple[object, dict]:
    """Replay the monitored method at the largest base budget (<= max_base, default kmax) whose mean resident pages
    <= target_pages.

    replay(base, monitor_factory, cap) -> ReplayResult; make_monitor(base, cap) -> monitor factory.
    Returns (the chosen ReplayResult, {"base_pages", "cap_pages", "mean_pages", "target_pages", "budget_matched"})."""
    rep, pages, c = None, float("inf"), cap
    for base in range(min(kmax, max_base or kmax), 0, -1):
        for c in sorted({cap, max(base, (cap + kmax) // 2), max(base, kmax + 1), max(base, kmax)}, reverse=True):
            rep = replay(base, make_monitor(base, c), c)
            pages = mean_resident_pages(rep.resident, page_chunks)
            if pages <= target_pages + 1e-9:
                return rep, {
                    "base_pages": base,
                    "cap_pages": c,
                    "mean_pages": pages,
                    "target_pages": target_pages,
                    "budget_matched": True,
                }
    return rep, {
        "base_pages": 1,
        "cap_pages": c,
        "mean_pages": pages,
        "target_pages": target_pages,
        "budget_matched": False,
    }
