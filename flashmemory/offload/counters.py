"""Offload counters, per request and in total: a plain-dict snapshot (`OffloadMetrics.snapshot`, a scan of every
request, for tests and reports) and running totals kept current as the core changes them (`OffloadMetrics.totals`,
O(1), what an exporter reads while requests decode)."""

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


class ResidencyCounts:
    """Running totals of what the live requests hold, by engine row: resident pages, resident chunks (chunks of a
    history whose page is resident: a recall block or a decode slot) and history chunks. `set_row` is called with a
    row's whole resident set each time the core rebuilds that row's resident table (every residency change ends
    there: admit, page open, promotion, spill, recall publish, eviction, finish); `append` once per decode chunk (a
    decode chunk always lands in a resident page). Both O(resident pages of one row) at most; reading is O(1)."""

    def __init__(self, page_chunks: int) -> None:
        self.pc = page_chunks
        self.by_row: dict[int, tuple[int, int, int]] = {}  # row -> (pages, chunks, history chunks)
        self.pages = self.chunks = self.history = 0

    def set_row(self, row: int, pages: list[int], n_chunks: int) -> None:
        """Row `row` holds resident logical `pages` of a history of `n_chunks` chunks ([] and 0: the row is empty)."""
        chunks = sum(min(self.pc, max(0, n_chunks - p * self.pc)) for p in pages)
        old = self.by_row.pop(row, (0, 0, 0))
        if pages or n_chunks:
            self.by_row[row] = (len(pages), chunks, n_chunks)
        self.pages += len(pages) - old[0]
        self.chunks += chunks - old[1]
        self.history += n_chunks - old[2]

    def append(self, row: int) -> None:
        """One decode chunk appended to row `row`, into a resident page."""
        p, c, h = self.by_row.get(row, (0, 0, 0))
        self.by_row[row] = (p, c + 1, h + 1)
        self.chunks += 1
        self.history += 1


class OffloadMetrics:
    """Counters keyed by request id, plus recall latency and last-cycle figures. Not thread-safe by itself:
    the engine updates it under its lock."""

    def __init__(self, page_chunks: int = 1) -> None:
        self.per_req: dict[Hashable, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
        self.finished: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # totals of requests already gone
        self.latency_s: list[float] = []
        self.last_cycle = {"pages": 0, "bytes": 0, "latency_s": 0.0}
        self.gauges: dict[Hashable, dict[str, float]] = {}  # per request: budget_pages, fallback, miss_mass_last
        self.miss_counts = [0] * len(MISS_BUCKETS)  # non-cumulative bucket counts
        self.miss_sum, self.miss_n = 0.0, 0
        self.miss_recent: list[float] = []  # the last <= MISS_RECENT values, oldest first
        # Running totals for `totals` (O(1) reads): per_req summed over live requests, the live requests' budget
        # gauges, and what they hold resident (`ResidencyCounts`, kept by the core's resident tables).
        self.live_sum: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.budget_sum, self.budget_n, self.fallback_n = 0.0, 0, 0
        self._gauged: dict[Hashable, tuple[float | None, int]] = {}  # rid -> (budget_pages, fallback) counted
        self.residency = ResidencyCounts(page_chunks)

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
        g = self.gauges.setdefault(rid, {})
        g.update(values)
        self._uncount_gauges(rid)
        if rid in self.per_req:  # a live request: its gauges enter the running mean and count
            budget = float(g["budget_pages"]) if "budget_pages" in g else None
            fallback = int(g.get("fallback", 0))
            self._gauged[rid] = (budget, fallback)
            if budget is not None:
                self.budget_sum += budget
                self.budget_n += 1
            self.fallback_n += fallback

    def _uncount_gauges(self, rid: Hashable) -> None:
        budget, fallback = self._gauged.pop(rid, (None, 0))
        if budget is not None:
            self.budget_sum -= budget
            self.budget_n -= 1
        self.fallback_n -= fallback

    def add(self, rid: Hashable, name: str, n: int = 1) -> None:
        self.per_req[rid][name] += n
        self.live_sum[name] += n

    def cycle(self, pages: int, nbytes: int, latency_s: float) -> None:
        self.last_cycle = {"pages": pages, "bytes": nbytes, "latency_s": latency_s}
        self.latency_s.append(latency_s)
        if len(self.latency_s) > 4096:  # bounded history
            del self.latency_s[:2048]

    def retire(self, rid: Hashable) -> None:
        for k, v in self.per_req.pop(rid, {}).items():
            self.finished[k] += v
            self.live_sum[k] -= v
        self.gauges.pop(rid, None)
        self._uncount_gauges(rid)

    def totals(self) -> dict[str, Any]:
        """The "total" figures an exporter needs, from running totals (O(1): no scan of requests or tables):
        every COUNTERS key (finished + live), resident_pages, resident_chunks, history_chunks, last_cycle,
        budget_pages_mean, in_fallback, miss_n (miss-mass values observed so far)."""
        total: dict[str, Any] = {k: self.finished[k] + self.live_sum[k] for k in COUNTERS}
        res = self.residency
        total.update(resident_pages=res.pages, resident_chunks=res.chunks, history_chunks=res.history)
        total["last_cycle"] = dict(self.last_cycle)
        total["budget_pages_mean"] = self.budget_sum / self.budget_n if self.budget_n else 0.0
        total["in_fallback"] = self.fallback_n
        total["miss_n"] = self.miss_n
        return total

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
