"""Offload counters, per request and in total, exported as a plain dict (`OffloadMetrics.snapshot`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Hashable

# Counters kept per request and summed in "total".
COUNTERS = (
    "recall_pages",      # pages copied mirror -> reserve
    "recall_bytes",      # bytes copied mirror -> reserve (c4 KV + Path-I index-K)
    "evictions",         # resident pages of this request evicted to make room
    "budget_hits",       # selected pages dropped: per-request cap or reserve exhausted
    "tail_drops",        # ... of which recency-tail pages (reserve exhausted even for the tail)
    "cycles",            # Level-1 cycles planned
    "cycles_skipped",    # due cycles skipped because the previous one was still in flight
    "cycles_late",       # cycles queued behind a busy worker
    "cancelled_pages",   # recalled pages discarded at publish (request finished, row reused, page remapped)
    "decode_chunks",     # chunks appended during decode
    "decode_spills",     # full decode pages that left the decode region without a recall block
    "decode_promotions", # full decode pages moved into a recall block
    "decode_page_opens", # pages opened in the decode region (partial page copied from the mirror)
)


class OffloadMetrics:
    """Counters keyed by request id, plus recall latency and last-cycle figures. Not thread-safe by itself:
    the engine updates it under its lock."""

    def __init__(self) -> None:
        self.per_req: dict[Hashable, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
        self.finished: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # totals of requests already gone
        self.latency_s: list[float] = []
        self.last_cycle = {"pages": 0, "bytes": 0, "latency_s": 0.0}

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

    def snapshot(self, resident: dict[Hashable, tuple[int, int]]) -> dict[str, Any]:
        """resident: rid -> (resident pages, resident chunks). Returns {"total": {...}, "requests": {rid: {...}}}."""
        reqs: dict[Any, dict[str, Any]] = {}
        total: dict[str, Any] = dict(self.finished)
        for rid, c in self.per_req.items():
            pages, chunks = resident.get(rid, (0, 0))
            reqs[rid] = dict(c, resident_pages=pages, resident_chunks=chunks)
            for k, v in c.items():
                total[k] += v
        total["resident_pages"] = sum(p for p, _ in resident.values())
        total["resident_chunks"] = sum(c for _, c in resident.values())
        lat = self.latency_s
        total["recall_latency_mean_s"] = sum(lat) / len(lat) if lat else 0.0
        total["recall_latency_max_s"] = max(lat) if lat else 0.0
        total["last_cycle"] = dict(self.last_cycle)
        return {"total": total, "requests": reqs}
