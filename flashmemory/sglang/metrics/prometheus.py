"""Offload-core statistics as Prometheus metrics, created in the scheduler process.

sglang serves /metrics from prometheus_client's multiprocess directory when `--enable-metrics` is on, so
plain prometheus_client metrics made here (gauges in "mostrecent" mode) show up there next to sglang's own.
Every series carries its scheduler's place (`RANK_LABELS`): the attention-DP rank, whose requests it counts, and
the rank in that DP rank's attention-TP group. Without the labels the multiprocess collector sums the counters of
all schedulers and keeps the gauge of whichever wrote last, so DP ranks with different requests would read as one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
    "miss_mass": (
        "histogram",
        "Share of the native top-k softmax mass outside the resident set, per request, per cycle",
    ),
    # Disk tier (SGLANG_PATHP_DISK_DIR); absent from stats() while it is off.
    "disk_bytes_read": ("counter", "Disk tier: page bytes read from the page store (verified)"),
    "disk_bytes_written": ("counter", "Disk tier: page bytes written behind to the page store"),
    "disk_cache_hits": ("counter", "Disk tier: recall page reads served from the host page cache"),
    "disk_cache_misses": ("counter", "Disk tier: recall page reads that were not in the host page cache"),
    "disk_cache_hit_rate": ("gauge", "Disk tier: host page cache hits / (hits + misses) so far"),
    "disk_recalls_waited": (
        "counter",
        "Disk tier: recalls whose copy waited for at least one disk read (missed the host cache)",
    ),
    "disk_readahead_late": (
        "counter",
        "Disk tier: page reads whose read-ahead had not arrived when the recall "
        "needed it (missed its window; the recall waited)",
    ),
    "disk_write_errors": ("counter", "Disk tier: write-behind failures (disk full, EIO); the page stayed in DRAM"),
    "disk_pages_in_dram_pinned": ("gauge", "Disk tier: pages kept in host DRAM after a failed write-behind"),
    "disk_corrupt_pages": ("counter", "Disk tier: pages that failed verification on read (their request failed)"),
    "disk_decode_waits": (
        "counter",
        "Disk tier: times the decode thread waited on disk I/O (a read its recall "
        "needed, a back-pressured write queue); 0 when read-ahead and write-behind "
        "keep up",
    ),
    "disk_write_waits": (
        "counter",
        "Disk tier: page admissions that waited for the write-behind thread (its "
        "queue was full: back-pressure, host memory stays bounded)",
    ),
    "disk_readahead_pages": (
        "counter",
        "Disk tier: page reads queued when a Level-1 selection named pages only on disk (before the plan)",
    ),
}
# Live state for an operator spotting a leak (`serving_gauges`): at idle live_requests is 0, free_reserve_blocks equals
# reserve_blocks and host_mirror_bytes_in_use is 0. Published with `stats()` when a request joins or leaves and at
# idle, and on their own after every decode forward.
SERVING_METRICS: dict[str, tuple[str, str]] = {
    "live_requests": ("gauge", "Requests holding an engine row (admitted, not yet released)"),
    "free_reserve_blocks": ("gauge", "Free recall blocks in the device reserve (equals reserve_blocks when idle)"),
    "reserve_blocks": ("gauge", "Recall blocks in the device reserve, free or not"),
    "host_mirror_bytes_in_use": ("gauge", "Host-mirror bytes held by live requests (0 when idle)"),
    "host_mirror_bytes": (
        "gauge",
        "Host-mirror DRAM: its page slots x page bytes (smaller than the pages' bytes "
        "with the disk tier's landing window, SGLANG_PATHP_HOST_MIRROR_GB)",
    ),
    "host_mirror_slots_in_use": ("gauge", "Host-mirror page slots holding a live page (0 when idle)"),
}
# sglang's own HiSparse on CPU (`flashmemory.sglang.cpu.hisparse_record.SwapInCounter`, keys in this order): counters
# of its torch swap-in, exported by a HiSparse decode server (--enable-hisparse) instead of the metrics above.
HISPARSE_SWAPIN_PREFIX = "hisparse_swapin_"
HISPARSE_SWAPIN: dict[str, str] = {
    "calls": "HiSparse swap-in calls (one per c4 layer per decode step)",
    "lookups": "HiSparse native top-k picks looked up in the device hot buffer",
    "hits": "HiSparse picks found in the hot buffer",
    "misses": "HiSparse picks copied host -> device into the hot buffer",
    "bytes_h2d": "HiSparse bytes copied host -> device (misses x 584 B)",
}
# The HiSparse prefetch mode (`flashmemory.sglang.hisparse.state.PrefetchCounter`, keys in this order); its
# on-demand misses are the swap-in counters' `misses` (prefetch copies are not swap-ins there).
HISPARSE_PREFETCH_PREFIX = "hisparse_prefetch_"
HISPARSE_PREFETCH: dict[str, str] = {
    "calls": "HiSparse prefetch calls (one per c4 layer per decode step with a hint)",
    "positions": "Hinted c4 positions handed to the prefetch after sanitizing (real, non-fast-path rows)",
    "resident": "Hinted positions already in the hot buffer (made most recent, nothing copied)",
    "loaded": "Hinted positions copied host -> device into the hot buffer ahead of need",
    "bytes_h2d": "HiSparse prefetch bytes copied host -> device (loaded x 584 B), off the step's critical path "
    "on a GPU",
    "dropped": "Hinted positions removed by sanitizing (at or past L-1, or without a host copy)",
    "used": "Prefetched entries a later top-k pick found in the hot buffer (prefetch hits; CPU attribution)",
    "wasted": "Prefetched entries evicted, or left at the request's end, before any pick used them (CPU attribution)",
}
FAILURES = ("request_failures", "Requests failed alone by the FlashMemory guard, by hook (the server kept serving)")
MONITOR_KEYS = (
    "monitor_cycles",
    "escalations",
    "escalations_denied",
    "missing_pages_added",
    "fallbacks",
    "budget_pages_mean",
    "requests_in_fallback",
    "miss_mass",
)
DISK_KEYS = tuple(k for k in METRICS if k.startswith("disk_"))  # in stats() only with the disk tier on
MISS_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)  # = flashmemory.offload.counters.MISS_BUCKETS
# Labels of every `FlashMemoryMetrics` series: the scheduler's attention-DP rank (0 without attention DP) and its
# rank among the ranks that run that DP rank's batch (its TP rank without attention DP). Ranks of one attention-TP
# group hold the same requests in lockstep, so their series agree; each DP rank's series are its own requests'.
RANK_LABELS = ("dp_rank", "attn_tp_rank")


def scheduler_ranks() -> dict[str, str]:
    """`RANK_LABELS` of this process from sglang's parallel context (`get_parallel()`: attn_dp_rank when attention
    DP is on, attn_tp_rank); "0" for each outside a server or before sglang published its ranks."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        dp = int(p.attn_dp_rank) if p.attn_dp_enabled else 0
        tp = int(p.attn_tp_rank)
    except (ImportError, AttributeError, RuntimeError, ValueError, TypeError):
        dp, tp = 0, 0
    return {"dp_rank": str(dp), "attn_tp_rank": str(tp)}


def failure_counter(registry: Any = None) -> Any:
    """flashmemory_request_failures_total{hook, dp_rank, attn_tp_rank} in `registry` (default: prometheus_client's),
    None without prometheus_client; a failure is counted as `.labels(hook=..., **scheduler_ranks())`. The process
    keeps the one it made in its guard (`RUNTIME.guard.counter`); a second in the same registry raises ValueError
    (prometheus_client refuses a duplicate name)."""
    try:
        from prometheus_client import REGISTRY, Counter
    except ImportError:
        return None
    reg = registry if registry is not None else REGISTRY
    return Counter(PREFIX + FAILURES[0], FAILURES[1], ["hook", *RANK_LABELS], registry=reg)


def ranked_counters(docs: Mapping[str, str], registry: Any = None) -> dict[str, Any]:
    """{name: Counter `name` with `RANK_LABELS`, as this scheduler's child (`scheduler_ranks()`)} in `registry`
    (default prometheus_client's): the HiSparse counters, one series per scheduler like every FlashMemory series.
    Raises ImportError without prometheus_client, ValueError for a name already registered."""
    from prometheus_client import REGISTRY, Counter

    reg = registry if registry is not None else REGISTRY
    mine = scheduler_ranks()
    return {name: Counter(name, doc, RANK_LABELS, registry=reg).labels(**mine) for name, doc in docs.items()}


def serving_gauges(adapter: Any) -> dict[str, float]:
    """The `SERVING_METRICS` of a Path-P adapter (`copy_adapter.CopyAdapter`): rows of the adapter (rid ->
    engine row), and the core's occupancy (free recall blocks, mirror pages in use), read under its lock."""
    return {"live_requests": float(len(adapter.rows)), **adapter.engine.occupancy()}


def adapter_stats(adapter: Any) -> dict[str, float]:
    """The keys of `METRICS` for a Path-P adapter (`offload_adapter.OffloadAdapter.stats`), from its core's running
    totals (O(1): no scan of requests, no device read; the exporter thread calls it): recall and warm-start
    traffic, Level-1 cycles, residency, the reserve's use, the device bytes the mode saves, the miss monitor's
    counters (with a monitor) and the disk tier's (with a tier)."""
    snap = adapter.engine.totals()
    hist = snap["history_chunks"]
    rb = adapter.cfg.recall_blocks
    from flashmemory.sglang.metrics.miss_monitor import monitor_stats  # torch and the core: only when serving

    monitor = monitor_stats(snap, adapter.engine.recent_misses()) if adapter.monitor is not None else {}
    return {
        "recall_bytes": float(snap["recall_bytes"]),
        "recall_pages": float(snap["recall_pages"]),
        "warm_start_pages": float(snap["warm_start_pages"]),
        "level1_cycles": float(snap["cycles"]),
        "resident_fraction": snap["resident_chunks"] / hist if hist else 0.0,
        "reserve_used_fraction": (rb - snap["free_blocks"]) / rb,
        "level1_cycle_seconds": float(snap["last_cycle"]["latency_s"]),
        "device_bytes_saved": float(adapter.device_bytes_saved),
        **monitor,
        **(adapter.tier.tier_stats() if adapter.tier is not None else {}),
    }


def metrics_table() -> str:
    """The metrics table of docs/metrics.md (Markdown), generated from METRICS, SERVING_METRICS, FAILURES,
    HISPARSE_SWAPIN and HISPARSE_PREFETCH."""
    rows = ["| Metric | Type | Meaning |", "|---|---|---|"]
    swapin = {HISPARSE_SWAPIN_PREFIX + k: ("counter", doc) for k, doc in HISPARSE_SWAPIN.items()}
    swapin.update({HISPARSE_PREFETCH_PREFIX + k: ("counter", doc) for k, doc in HISPARSE_PREFETCH.items()})
    for key, (kind, doc) in {**METRICS, **SERVING_METRICS, FAILURES[0]: ("counter", FAILURES[1]), **swapin}.items():
        name = PREFIX + key + ("_total" if kind == "counter" else "")
        if key == FAILURES[0]:
            name += "{hook}"  # besides the rank labels every series carries
        rows.append(f"| `{name}` | {kind} | {doc} |")
    return "\n".join(rows)


@dataclass
class FlashMemoryMetrics:
    metrics: dict[str, Any]
    last: dict[str, float]
    live_seen: float = -1.0  # live_requests at the last full publish

    @classmethod
    def create(cls, registry: Any = None, ranks: Mapping[str, str] | None = None) -> "FlashMemoryMetrics":
        """Every metric in `registry` (default prometheus_client's), each the child of this scheduler's
        `RANK_LABELS` values `ranks` (default `scheduler_ranks()`)."""
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = registry if registry is not None else REGISTRY
        mine = dict(ranks) if ranks is not None else scheduler_ranks()
        m: dict[str, Any] = {}
        for key, (kind, doc) in {**METRICS, **SERVING_METRICS}.items():
            if kind == "counter":
                metric = Counter(PREFIX + key, doc, RANK_LABELS, registry=reg)
            elif kind == "histogram":
                metric = Histogram(PREFIX + key, doc, RANK_LABELS, registry=reg, buckets=MISS_BUCKETS)
            else:
                metric = Gauge(PREFIX + key, doc, RANK_LABELS, registry=reg, multiprocess_mode="mostrecent")
            m[key] = metric.labels(**mine)
        return cls(m, {})

    def publish(self, stats: Mapping[str, float]) -> None:
        """Export one `stats()` snapshot; unknown keys are ignored, counters advance by the delta. A histogram's value
        is (observations so far, the most recent values, oldest first): the new ones are observed."""
        for key, value in stats.items():
            metric = self.metrics.get(key)
            if metric is None:
                continue
            kind = (METRICS.get(key) or SERVING_METRICS[key])[0]
            if kind == "histogram":
                total, recent = value
                new = int(total) - int(self.last.get(key, 0))
                for v in list(recent)[len(recent) - min(max(new, 0), len(recent)) :]:
                    metric.observe(float(v))
                self.last[key] = float(total)
            elif kind == "counter":
                delta = float(value) - self.last.get(key, 0.0)
                if delta > 0:
                    metric.inc(delta)
                self.last[key] = float(value)
            else:
                metric.set(float(value))

    def refresh(self, adapter: Any, full: bool = False) -> None:
        """Publish the serving gauges; with them every `stats()` key when `full` or when the number of live requests
        changed since the last full publish (a request joined or left: the fractions changed too)."""
        gauges = serving_gauges(adapter)
        if full or gauges["live_requests"] != self.live_seen:
            self.publish({**adapter.stats(), **gauges})
            self.live_seen = gauges["live_requests"]
        else:
            self.publish(gauges)
