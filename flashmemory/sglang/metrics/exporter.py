"""`MetricsExporter`: the metrics and diagnostics export, off the decode thread.

The decode thread only marks an export due (`kick`: an Event set and a flag, no lock, no read of the core); a daemon
thread wakes, runs the export (`Runtime.export`: the adapter's `stats()` and serving gauges, which read the core's
running totals under its lock, O(1), no device read; the prometheus publish; the diagnostics file) and sleeps again.
Kicks that arrive while an export runs coalesce into one more (counters are running totals, so nothing is lost).
`flush` runs a due export on the caller's thread (idle time, tests); one export runs at a time.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class MetricsExporter:
    """work(full): one export; full=True asks for every metric, not only the serving gauges."""

    def __init__(self, work: Callable[[bool], None]) -> None:
        self.work = work
        self._due = threading.Event()
        self._full = False
        self._run_lock = threading.Lock()  # one export at a time (the thread, a flush)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.exports = 0  # exports run so far

    def start(self) -> MetricsExporter:
        """Start the daemon thread (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="flashmemory-metrics", daemon=True)
            self._thread.start()
        return self

    def kick(self, full: bool = False) -> None:
        """Mark an export due (decode thread: O(1), takes no lock)."""
        if full:
            self._full = True
        self._due.set()

    def flush(self) -> bool:
        """Run a due export now, on the caller's thread; False if none was due."""
        with self._run_lock:
            if not self._due.is_set():
                return False
            self._due.clear()
            full, self._full = self._full, False
            self.work(full)
            self.exports += 1
            return True

    def close(self) -> None:
        """Stop the thread after its current export (a pending kick is dropped)."""
        self._closed = True
        self._due.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._due.clear()

    def _loop(self) -> None:
        while True:
            self._due.wait()
            if self._closed:
                return
            try:
                self.flush()
            except Exception:  # an export must never take the server down; the next kick tries again
                logger.exception("FlashMemory: metrics export failed")


def write_diagnostics(rt: Any) -> None:
    """Write a runtime's counters, buffer shapes and engine stats as JSON to its `diag_path`
    ($FLASHMEMORY_STATS_FILE, atomic), if set; rank r > 0 of a distributed server writes `<file>.rank<r>` (each
    rank's engine is its own). rt: `runtime.Runtime`."""
    if not rt.diag_path:
        return
    from flashmemory.offload.tiered_mirror import dist_rank

    rank = dist_rank()
    path = rt.diag_path + (f".rank{rank}" if rank else "")
    d: dict[str, Any] = {
        "features": list(rt.features),
        "decode_forwards": rt.steps,
        **dict(rt.counters),  # one C-level copy: the decode thread may add a counter meanwhile
        "level2_bufs": list(rt.bufs.sel_pages.shape) if rt.bufs is not None else None,
    }
    if rt.engine is not None:
        if os.path.exists(path) and rt.engine.live_history() == 0:
            return  # no live request (idle flush): the file keeps the last decode step's state
        d.update(rt.engine.stats())
        d["mode"] = rt.engine.mode
    weights = next(iter(rt.retriever.parameters()), None) if rt.retriever is not None else None
    d["retriever_device"] = str(weights.device) if weights is not None else None
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(d, f)
    os.replace(tmp, path)
