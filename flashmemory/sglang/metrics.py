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
    "level1_cycles": ("counter", "Level-1 cycles completed"),
    "resident_fraction": ("gauge", "Resident c4 chunks / c4 chunks of live requests"),
    "reserve_used_fraction": ("gauge", "Used fraction of the device reserve"),
    "level1_cycle_seconds": ("gauge", "Wall time of the last Level-1 cycle"),
    "device_bytes_saved": ("gauge", "Device bytes Path-P freed (c4 KV pool minus reserve); 0 in copy mode"),
}


@dataclass
class FlashMemoryMetrics:
    metrics: dict[str, Any]
    last: dict[str, float]

    @classmethod
    def create(cls, registry: Any = None) -> "FlashMemoryMetrics":
        from prometheus_client import REGISTRY, Counter, Gauge
        reg = registry if registry is not None else REGISTRY
        m: dict[str, Any] = {}
        for key, (kind, doc) in METRICS.items():
            if kind == "counter":
                m[key] = Counter(PREFIX + key, doc, registry=reg)
            else:
                m[key] = Gauge(PREFIX + key, doc, registry=reg, multiprocess_mode="mostrecent")
        return cls(m, {})

    def publish(self, stats: Mapping[str, float]) -> None:
        """Export one `stats()` snapshot; unknown keys are ignored, counters advance by the delta."""
        for key, value in stats.items():
            metric = self.metrics.get(key)
            if metric is None:
                continue
            if METRICS[key][0] == "counter":
                delta = float(value) - self.last.get(key, 0.0)
                if delta > 0:
                    metric.inc(delta)
                self.last[key] = float(value)
            else:
                metric.set(float(value))
