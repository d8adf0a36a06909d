"""What the CPU HiSparse swap-in records, per process: running counters (`SwapInCounter`, in
`RUNTIME.hisparse.swapin`) and, with FLASHMEMORY_HISPARSE_TRACE set, a JSON-lines trace of every swap-in call and
every direct admission (`trace_swapin`, `trace_write`), for `eval.hisparse_trace.replay_trace`.

The counters are lookups, hits, misses and bytes copied host -> device (misses x 584 B) plus calls; they are
exported as Prometheus counters (`flashmemory_hisparse_swapin_*`, D's /metrics with --enable-metrics) and logged
every `LOG_EVERY` calls. The hooks that feed them live in `patches_hisparse.py`.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch

from flashmemory.sglang.cpu.ops.hisparse import SwapInCounts
from flashmemory.sglang.decode.runtime import RUNTIME

logger = logging.getLogger(f"sglang.{__name__}")
LOG_EVERY = 256  # swap-in calls between two counter log lines


class SwapInCounter:
    """Running totals of the torch swap-in (thread safe), mirrored to Prometheus counters when available."""

    KEYS = ("calls", "lookups", "hits", "misses", "bytes_h2d")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals = dict.fromkeys(self.KEYS, 0)
        self.prom: dict[str, Any] | None = None

    def add(self, c: SwapInCounts) -> dict[str, int]:
        with self.lock:
            step = {"calls": 1, "lookups": c.lookups, "hits": c.hits, "misses": c.misses, "bytes_h2d": c.bytes_h2d}
            for k, v in step.items():
                self.totals[k] += v
            snap = dict(self.totals)
        self._export(step)
        if snap["calls"] % LOG_EVERY == 1:
            logger.info("FlashMemory HiSparse CPU swap-in: %s", " ".join(f"{k}={v}" for k, v in snap.items()))
        return snap

    def _export(self, step: dict[str, int]) -> None:
        if self.prom is None:
            self.prom = {}
            try:
                from flashmemory.sglang.metrics.prometheus import (
                    HISPARSE_SWAPIN,
                    HISPARSE_SWAPIN_PREFIX,
                    PREFIX,
                    ranked_counters,
                )

                made = ranked_counters({PREFIX + HISPARSE_SWAPIN_PREFIX + k: HISPARSE_SWAPIN[k] for k in self.KEYS})
                self.prom = {k: made[PREFIX + HISPARSE_SWAPIN_PREFIX + k] for k in self.KEYS}
            except (ImportError, ValueError) as e:  # no prometheus_client, or registered twice in this process
                logger.warning("FlashMemory HiSparse: swap-in counters not exported (%s)", e)
        for k, m in self.prom.items():
            if step[k]:
                m.inc(step[k])

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.totals)


def swapin() -> SwapInCounter:
    """The process's swap-in counter (`RUNTIME.hisparse.swapin`), created on first use."""
    if RUNTIME.hisparse.swapin is None:
        RUNTIME.hisparse.swapin = SwapInCounter()
    return RUNTIME.hisparse.swapin


def swapin_counts() -> dict[str, int]:
    """The process's swap-in totals: calls, lookups, hits, misses, bytes_h2d (misses x 584 B)."""
    return swapin().snapshot()


def trace_path() -> str:
    """FLASHMEMORY_HISPARSE_TRACE, read once per process ("" = no trace; `RUNTIME.hisparse.trace_path`)."""
    st = RUNTIME.hisparse
    if st.trace_path is None:
        from flashmemory.env import hisparse_trace

        st.trace_path = hisparse_trace()
    return st.trace_path


def trace_write(rec: dict[str, Any]) -> None:
    """Append one record to the trace file as a compact JSON line (under the trace lock: hooks run on several
    threads)."""
    st = RUNTIME.hisparse
    with st.trace_lock, open(st.trace_path or "", "a") as f:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def trace_swapin(
    layer_state: torch.Tensor,
    picks: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    hot: int,
    c: SwapInCounts,
) -> None:
    """One JSON line per swap-in call: {"ev": "swapin", "layer": c4 layer index (by the layer's state tensor, in
    order of first call), "hot", "k", "rows": [[request slot, compressed length, [picks]] per real row], and the
    op's "lookups", "hits", "misses"}. picks: int [real rows, k], taken before the op ran."""
    st = RUNTIME.hisparse
    with st.trace_lock:
        layer = st.trace_layers.setdefault(int(layer_state.data_ptr()), len(st.trace_layers))
    rows = [[int(req_pool_indices[b]), int(seq_lens[b]), picks[b].tolist()] for b in range(picks.shape[0])]
    trace_write(
        {
            "ev": "swapin",
            "layer": layer,
            "hot": hot,
            "k": int(picks.shape[1]),
            "rows": rows,
            "lookups": c.lookups,
            "hits": c.hits,
            "misses": c.misses,
        }
    )
