"""Offload-core statistics as Prometheus metrics, created in the scheduler process.

sglang serves /metrics from prometheus_client's multiprocess directory when `--enable-metrics` is on, so
plain prometheus_client metrics made here (gauges in "mostrecent" mode) show up there next to sglang's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

PREFIX = "flashmemory_"
# stat key -> (kind, help); keys the offload core's `stats()` may report. Counters take running totals.
METRICS: dict[str, tuple[str, str]] = {
    "recall_bytes": ("counter", "Bytes copied host -> device by recalls"),
    "recall_pages": ("counter", "Pages recalled into the device reserve"),
    "warm_start_pages": ("counter", "Of those, pages recalled when a request was admitted (before its first cycle)"),
    "level1_cycles": ("counter", "Level-1 cycles completed"),
    "resident_fraction": ("gauge", "Resident c4 chunks / c4 chunks of live requests"),
    "reserve_used_fraction": ("gauge", "Used fraction of the device reserve"),
    "level1_cycle_seconds": ("gauge", "Wall time of the last Level-1 cycle"),
    "device_bytes_saved": ("gauge", "Device bytes Path-P freed (c4 KV pool minus reserve); 0 in copy mode"),
    # Miss monitor (SGLANG_RETRIEVER_MISS_MONITOR=1); absent from stats() while it is off.
    "monitor_cycles": ("counter", "Level-1 cycles whose native miss mass was measured"),
    "escalations": ("counter", "Cycles whose miss mass passed SGLANG_RETRIEVER_MISS_THRESHOLD"),
    "escalations_denied": ("counter", "Escalations that could not widen the budget as asked (cap, pool, reserve)"),
    "missing_pages_added": ("counter", "Pages the monitor saw missing, added beside the retriever's picks"),
    "fallbacks": ("counter", "Requests switched to the exact-recall fallback (latest native top-k pages held)"),
    "budget_pages_mean": ("gauge", "Mean Level-1 page budget of the live requests (KMAX unless escalated)"),
    "requests_in_fallback": ("gauge", "Live requests in the exact-recall fallback"),
    "miss_mass": ("histogram", "Share of the native top-k softmax mass outside the resident set, per request, "
                               "per cycle"),
}
MONITOR_KEYS = ("monitor_cycles", "escalations", "escalations_denied", "missing_pages_added", "fallbacks",
                "budget_pages_mean", "requests_in_fallback", "miss_mass")
MISS_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)  # = flashmemory.offload.counters.MISS_BUCKETS


@dataclass
class FlashMemoryMetrics:
    metrics: dict[str, Any]
    last: dict[str, float]

    @classmethod
    def create(cls, registry: Any = None) -> "FlashMemoryMetrics":
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram
        reg = registry if registry is not None else REGISTRY
        m: dict[str, Any] = {}
        for key, (kind, doc) in METRICS.items():
            if kind == "counter":
                m[key] = Counter(PREFIX + key, doc, registry=reg)
            elif kind == "histogram":
                m[key] = Histogram(PREFIX + key, doc, registry=reg, buckets=MISS_BUCKETS)
            else:
                m[key] = Gauge(PREFIX + key, doc, registry=reg, multiprocess_mode="mostrecent")
        return cls(m, {})

    def publish(self, stats: Mapping[str, float]) -> None:
        """Export one `stats()` snapshot; unknown keys are ignored, counters advance by the delta. A histogram's value
        is (observations so far, the most recent values, oldest first): the new ones are observed."""
        for key, value in stats.items():
            metric = self.metrics.get(key)
            if metric is None:
                continue
            if METRICS[key][0] == "histogram":
                total, recent = value
                new = int(total) - int(self.last.get(key, 0))
                for v in list(recent)[len(recent) - min(max(new, 0), len(recent)):]:
                    metric.observe(float(v))
                self.last[key] = float(total)
            elif METRICS[key][0] == "counter":
                delta = float(value) - self.last.get(key, 0.0)
                if delta > 0:
                    metric.inc(delta)
                self.last[key] = float(value)
            else:
                metric.set(float(value))
