"""Offload counters, per request and in total, exported as a plain dict (`OffloadMetrics.snapshot`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from typing import Any

# Counters kept per request and summed in "total".
COUNTERS = (
    "recall_pages",  # pages copied mirror -> reserve
    "recall_bytes",  # bytes copied mirror -> reserve (c4 KV + Path-I index-K)
    "warm_start_pages",  # ... of the recall_pages, those recalled at admission (not by a Level-1 cycle)
    "evictions",  # resident pages of this request evicted to make room
    "budget_hits",  # selected pages dropped: per-request cap or reserve exhausted
    "tail_drops",  # ... of which recency-tail pages (reserve exhausted even for the tail)
    "cycles",  # Level-1 cycles planned
    "cycles_skipped",  # due cycles skipped because the previous one was still in flight
    "cycles_late",  # cycles queued behind a busy worker
    "cancelled_pages",  # recalled pages discarded at publish (request finished, row reused, page remapped)
    "decode_chunks",  # chunks appended during decode
    "decode_spills",  # full decode pages that left the decode region without a recall block
    "decode_promotions",  # full decode pages moved into a recall block
    "decode_page_opens",  # pages opened in the decode region (partial page copied from the mirror)
    # Miss monitor and escalation (flashmemory.residency.escalation); zero while the monitor is off.
    "monitor_cycles",  # cycles whose native miss mass was measured
    "escalations",  # cycles whose miss mass passed SGLANG_RETRIEVER_MISS_THRESHOLD
    "escalations_denied",  # ... whose budget could not widen as asked (cap, shared pool or reserve pressure)
    "missing_pages_added",  # pages the monitor saw missing, added beside the policy's picks
    "shrinks",  # budget steps given back after low-miss cycles
    "fallbacks",  # switches to the exact-recall fallback (latest native top-k pages held)
    "fallback_exits",  # ... and back
    "fallback_cycles",  # cycles spent in the fallback
)
# Upper bucket edges of the miss-mass histogram (Prometheus style: value <= edge; the last is 1.0).
MISS_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
MISS_RECENT = 4096  # recent miss-mass values kept for exporters (bounded)


class OffloadMetrics:
    """Counters keyed by request id, plus recall latency and last-cycle figures. Not thread-safe by itself:
    the engine updates it under its lock."""

    def __init__(self) -> None:
        self.per_req: dict[Hashable, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
        self.finished: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # totals of requests already gone
        self.latency_s: list[float] = []
        self.last_cycle = {"pages": 0, "bytes": 0, "latency_s": 0.0}
        self.gauges: dict[Hashable, dict[str, float]] = {}  # per request: budget_pages, fallback, miss_mass_last
        self.miss_counts = [0] * len(MISS_BUCKETS)  # non-cumulative bucket counts
        self.miss_sum, self.miss_n = 0.0, 0
        self.miss_recent: list[float] = []  # the last <= MISS_RECENT values, oldest first

    def observe_miss(self, value: float) -> None:
        """One miss-mass measurement (a float in [0, 1]; non-finite values are rejected here, where they enter)."""
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"miss mass {value!r} outside [0, 1]")
        self.miss_counts[next(i for i, e in enumerate(MISS_BUCKETS) if value <= e)] += 1
        self.miss_sum += value
        self.miss_n += 1
        self.miss_recent.append(value)
        if len(self.miss_recent) > MISS_RECENT:
            del self.miss_recent[: MISS_RECENT // 2]

    def gauge(self, rid: Hashable, **values: float) -> None:
        self.gauges.setdefault(rid, {}).update(values)

    def add(self, rid: Hashable, name: str, n: int = 1) -> None:
        self.per_req[rid][name] += n

    def cycle(self, pages: int, nbytes: int, latency_s: float) -> None:
        self.last_cycle = {"pages": pages, "bytes": nbytes, "latency_s": latency_s}
        self.latency_s.append(latency_s)
        if len(self.latency_s) > 4096:  # bounded history
            del self.latency_s[:2048]

    def retire(self, rid: Hashable) -> None:
        for k, v in self.per_req.pop(rid, {}).items():
            self.finished[k] += v
        self.gauges.pop(rid, None)

    def snapshot(self, resident: dict[Hashable, tuple[int, int]]) -> dict[str, Any]:
        """resident: rid -> (resident pages, resident chunks). Returns {"total": {...}, "requests": {rid: {...}}}."""
        reqs: dict[Any, dict[str, Any]] = {}
        total: dict[str, Any] = dict(self.finished)
        for rid, c in self.per_req.items():
            pages, chunks = resident.get(rid, (0, 0))
            reqs[rid] = dict(c, resident_pages=pages, resident_chunks=chunks, **self.gauges.get(rid, {}))
            for k, v in c.items():
                total[k] += v
        total["resident_pages"] = sum(p for p, _ in resident.values())
        total["resident_chunks"] = sum(c for _, c in resident.values())
        lat = self.latency_s
        total["recall_latency_mean_s"] = sum(lat) / len(lat) if lat else 0.0
        total["recall_latency_max_s"] = max(lat) if lat else 0.0
        total["last_cycle"] = dict(self.last_cycle)
        budgets = [g["budget_pages"] for rid, g in self.gauges.items() if rid in self.per_req and "budget_pages" in g]
        total["budget_pages_mean"] = sum(budgets) / len(budgets) if budgets else 0.0
        total["budget_pages_max"] = max(budgets) if budgets else 0
        total["in_fallback"] = sum(int(g.get("fallback", 0)) for rid, g in self.gauges.items() if rid in self.per_req)
        total["miss_mass"] = {
            "buckets": list(MISS_BUCKETS),
            "counts": list(self.miss_counts),
            "sum": self.miss_sum,
            "n": self.miss_n,
        }
        return {"total": total, "requests": reqs}
