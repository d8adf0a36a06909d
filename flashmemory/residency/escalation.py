"""Per-request budget escalation and exact-recall fallback, driven by the miss monitor.

State per request (keyed by engine row and generation, so a reused row starts fresh):
  budget    pages handed to the Level-1 policy: `base` .. `cap`
  grant     budget - base, borrowed from a pool shared by all requests (`extra_pool` pages in total)
  high/low  consecutive cycles with miss mass above `threshold` / at or below `low_threshold`
  fallback  holding the latest native top-k pages (the Reactive union) beside the retriever's picks

Per cycle (`observe`, one `MissReport`):
  miss > threshold      the pages the monitor saw missing are added this cycle (`extra_pages`; held while the
                        monitored layer keeps a top-k pick on them), and the budget
                        widens by `step` pages for the next cycles, up to `cap` and as far as the shared pool
                        and the reserve's free blocks allow (a shortfall is counted as `escalations_denied`,
                        never raised). After `fallback_after` such cycles in a row the request falls back.
  miss <= low_threshold after `shrink_after` such cycles in a row the budget gives `step` pages back to the pool
                        (never below `base`) and a fallback ends.
Invariants (the state-machine test checks them): base <= budget <= cap for every request; the grants of the
live requests sum to `granted` <= extra_pool; a request that finishes (or whose row is reused) returns its
grant at once (`forget`, `sync`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flashmemory.residency.monitor import MissReport

# Priorities handed to the recall planner (higher = kept first; the recency tail is +inf). Retriever page
# priorities are chunk scores (sigmoids, or small counts for the replay baselines), so these rank above them.
MISSING_PRIORITY = 1e9  # + the page's missed mass
FALLBACK_PRIORITY = 1e8


@dataclass(frozen=True)
class EscalationConfig:
    threshold: float = 0.2  # miss mass above this escalates (SGLANG_RETRIEVER_MISS_THRESHOLD)
    low_threshold: float = 0.05  # at or below this counts towards shrinking back (SGLANG_RETRIEVER_MISS_LOW)
    base: int = 96  # pages without escalation (KMAX)
    cap: int = 192  # most pages a request may be widened to (SGLANG_RETRIEVER_MISS_KMAX_CAP)
    step: int = 32  # pages added per escalation / returned per shrink
    shrink_after: int = 2  # low cycles in a row before giving pages back (SGLANG_RETRIEVER_MISS_SHRINK_AFTER)
    fallback_after: int = 2  # high cycles in a row before the exact-recall fallback
    extra_pool: int = 1 << 30  # pages above base, summed over live requests (reserve pressure)
    topk: int = 512  # the native indexer's top-k the miss mass is measured on
    fallback_history: int = 3  # monitor cycles whose top-k pages the fallback holds (one per rotated layer)

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_threshold <= self.threshold <= 1.0:
            raise ValueError(f"EscalationConfig: need 0 <= low_threshold <= threshold <= 1: {self}")
        if not 1 <= self.base <= self.cap or self.step < 1 or self.topk < 1:
            raise ValueError(f"EscalationConfig: need 1 <= base <= cap, step >= 1, topk >= 1: {self}")
        if min(self.shrink_after, self.fallback_after, self.fallback_history) < 1 or self.extra_pool < 0:
            raise ValueError(f"EscalationConfig: patience and history must be >= 1, extra_pool >= 0: {self}")


@dataclass
class _Req:
    gen: int
    budget: int
    high: int = 0
    low: int = 0
    cycles: int = 0
    fallback: bool = False
    topk_history: list[torch.Tensor] = field(default_factory=list)
    held: dict[int, float] = field(default_factory=dict)  # pages the monitor added, kept while still attended


@dataclass(frozen=True)
class Decision:
    """What `observe` did: the request's new budget and state, and the event counters it raised."""

    budget: int
    fallback: bool
    events: dict[str, int]


class EscalationController:
    """Thread safe (Level 1 calls it from its worker; finishing requests from the decode thread)."""

    def __init__(self, cfg: EscalationConfig, free_blocks: Callable[[], int] | None = None):
        """free_blocks: the reserve's free recall blocks now (a widening never exceeds them)."""
        self.cfg = cfg
        self.free_blocks = free_blocks
        self._reqs: dict[int, _Req] = {}
        self.granted = 0
        self._mu = threading.Lock()

    def _get(self, row: int, gen: int) -> _Req:
        st = self._reqs.get(row)
        if st is not None and st.gen > gen:  # stale work of a finished request (generations only grow): detached
            return _Req(gen, self.cfg.base)
        if st is None or st.gen != gen:
            if st is not None:
                self.granted -= st.budget - self.cfg.base
            st = self._reqs[row] = _Req(gen, self.cfg.base)
        return st

    def budget(self, row: int, gen: int) -> int:
        with self._mu:
            return self._get(row, gen).budget

    def cycle_index(self, row: int, gen: int) -> int:
        """The request's monitor cycles so far (picks the rotated layer)."""
        with self._mu:
            return self._get(row, gen).cycles

    def observe(self, row: int, gen: int, rep: MissReport) -> Decision:
        cfg, ev = self.cfg, {"monitor_cycles": 1}
        with self._mu:
            st = self._get(row, gen)
            st.cycles += 1
            st.topk_history = (st.topk_history + [rep.topk_pages])[-cfg.fallback_history :]
            attended = set(rep.topk_pages.tolist())
            st.held = {p: m for p, m in st.held.items() if p in attended}
            if rep.miss_mass > cfg.threshold:
                st.held.update(zip(rep.missing_pages.tolist(), rep.missing_mass.tolist()))
            if rep.miss_mass > cfg.threshold:
                st.high, st.low = st.high + 1, 0
                ev["escalations"] = 1
                want = min(cfg.cap, st.budget + cfg.step) - st.budget
                room = cfg.extra_pool - self.granted
                if self.free_blocks is not None:
                    room = min(room, max(0, self.free_blocks()))
                got = max(0, min(want, room))
                if got < want:
                    ev["escalations_denied"] = 1
                st.budget += got
                self.granted += got
                if st.high >= cfg.fallback_after and not st.fallback:
                    st.fallback = True
                    ev["fallbacks"] = 1
            elif rep.miss_mass <= cfg.low_threshold:
                st.high, st.low = 0, st.low + 1
                if st.low >= cfg.shrink_after:
                    st.low = 0
                    give = min(cfg.step, st.budget - cfg.base)
                    if give > 0:
                        st.budget -= give
                        self.granted -= give
                        ev["shrinks"] = 1
                    if st.fallback:
                        st.fallback = False
                        ev["fallback_exits"] = 1
            else:
                st.high = st.low = 0
            if st.fallback:
                ev["fallback_cycles"] = 1
            return Decision(st.budget, st.fallback, ev)

    def extra_pages(self, row: int, gen: int) -> tuple[list[int], list[float]]:
        """Pages to add beside the policy's picks this cycle, with their recall priorities: the pages the monitor
        saw missing (added when the miss mass passed the threshold, held while the monitored layer still has a
        top-k pick on them), then, in fallback, the recent native top-k pages. Call after `observe`."""
        out: dict[int, float] = {}
        with self._mu:
            st = self._get(row, gen)
            if st.fallback:
                for pages in st.topk_history:
                    for p in pages.tolist():
                        out[int(p)] = FALLBACK_PRIORITY
            for p, m in st.held.items():
                out[int(p)] = MISSING_PRIORITY + float(m)
        return list(out), list(out.values())

    def forget(self, row: int) -> None:
        """The request in `row` finished: its grant goes back to the pool."""
        with self._mu:
            st = self._reqs.pop(row, None)
            if st is not None:
                self.granted -= st.budget - self.cfg.base

    def sync(self, live: Mapping[int, int]) -> None:
        """Drop every request not in `live` (row -> generation)."""
        with self._mu:
            for row in [r for r, st in self._reqs.items() if live.get(r) != st.gen]:
                st = self._reqs.pop(row)
                self.granted -= st.budget - self.cfg.base

    def snapshot(self) -> dict[int, tuple[int, int, bool]]:
        """row -> (generation, budget, fallback) of the tracked requests."""
        with self._mu:
            return {r: (st.gen, st.budget, st.fallback) for r, st in self._reqs.items()}
