"""The HiSparse prefetch mode's process state (`state()`, in `RUNTIME.hisparse.prefetch`): the per-request hint
queues, the static buffers a decode forward publishes into, the side stream (CUDA) or the CPU hit attribution
(`Provenance`), and the counters (`PrefetchCounter`, exported as `flashmemory_hisparse_prefetch_*`).

Invariants: every buffer is allocated once by `PrefetchState.configure` (before any CUDA-graph capture) with
`width` and `budget` capped at H - K, so a prefetch never evicts a current pick; `pf_pos` / `pf_clean` / `scratch`
are int32 [request slots, W] (-1 = none) and `pf_active` an int32 [1] row count read by the kernel on the device.
`resident_hint` turns a Level-1 resident set (pages) into a hint. The hooks that use this state live in
`prefetch.py`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from flashmemory.sglang.cpu.ops.hisparse_prefetch import Provenance, dedup_positions
from flashmemory.sglang.decode.runtime import RUNTIME

logger = logging.getLogger(f"sglang.{__name__}")


def streams_on(device: torch.device) -> bool:
    """Whether the prefetch runs on a side stream (CUDA); the test stand-in replaces this like `offload.streams`."""
    from flashmemory.offload.streams import streams_on as on

    return on(device)


class PrefetchCounter:
    """Running totals (thread safe), mirrored to Prometheus counters `flashmemory_hisparse_prefetch_<key>`."""

    KEYS = ("calls", "positions", "resident", "loaded", "bytes_h2d", "dropped", "used", "wasted")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals = dict.fromkeys(self.KEYS, 0)
        self.prom: dict[str, Any] | None = None

    def add(self, **step: int) -> None:
        with self.lock:
            for k, v in step.items():
                self.totals[k] += int(v)
        self._export(step)

    def _export(self, step: dict[str, int]) -> None:
        if self.prom is None:
            self.prom = {}
            try:
                from flashmemory.sglang.metrics.prometheus import (
                    HISPARSE_PREFETCH,
                    HISPARSE_PREFETCH_PREFIX,
                    PREFIX,
                    ranked_counters,
                )

                made = ranked_counters({PREFIX + HISPARSE_PREFETCH_PREFIX + k: HISPARSE_PREFETCH[k] for k in self.KEYS})
                self.prom = {k: made[PREFIX + HISPARSE_PREFETCH_PREFIX + k] for k in self.KEYS}
            except (ImportError, ValueError) as e:  # no prometheus_client, or registered twice in this process
                logger.warning("FlashMemory HiSparse prefetch: counters not exported (%s)", e)
        for k, v in step.items():
            if v and k in self.prom:
                self.prom[k].inc(v)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.totals)


class PrefetchState:
    """The mode's process state: hint queues, static buffers, the side stream and CPU attribution."""

    def __init__(self) -> None:
        self.width = 0  # W: positions per request per step (<= H - K)
        self.budget = 0  # positions per request per cycle (<= H - K)
        self.pending: dict[str, torch.Tensor] = {}  # request id -> int64 positions not yet published
        self.pf_pos: torch.Tensor | None = None  # int32 [rows, W], -1 = none (static)
        self.pf_clean: torch.Tensor | None = None  # int32 [rows, W] sanitized copy (static, side stream)
        self.pf_active: torch.Tensor | None = None  # int32 [1]: rows to prefetch this forward, 0 = none
        self.scratch: torch.Tensor | None = None  # int32 [rows, W] the prefetch's output (never the step's)
        self.active = 0  # host copy of pf_active
        self.stream: Any = None
        self.provenance: Provenance | None = None
        self.counts = PrefetchCounter()
        self.lock = threading.Lock()

    def configure(
        self, hot: int, top_k: int, rows: int, n_layers: int, device: torch.device, width: int, budget: int
    ) -> None:
        """Allocate every buffer once (before any CUDA-graph capture). hot = H, top_k = K, rows = request slots
        of the coordinator, n_layers = c4 layers; width / budget as set (0 budget = H - K), both capped at H-K."""
        room = hot - top_k
        if room < 1:
            from flashmemory.sglang.plumbing.patching import StartupError

            raise StartupError(
                f"SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1: the hot buffer ({hot} slots) leaves no room "
                f"beside the top-{top_k} picks; raise --hisparse-config device_buffer_size above "
                f"{top_k}"
            )
        self.width = min(width, room)
        self.budget = min(budget or room, room)
        self.pf_pos = torch.full((rows, self.width), -1, dtype=torch.int32, device=device)
        self.pf_clean = self.pf_pos.clone()
        self.scratch = self.pf_pos.clone()
        self.pf_active = torch.zeros(1, dtype=torch.int32, device=device)
        self.pending.clear()
        if streams_on(device):
            self.stream = torch.cuda.Stream(device, priority=0)
            self.provenance = None
        else:
            self.stream = None
            self.provenance = Provenance(n_layers, rows, hot + 64)

    def set_hint(self, rid: str, positions: torch.Tensor) -> int:
        """Replace request `rid`'s pending hint with `positions` (int [N], priority order): deduplicated, capped at
        the cycle budget. Returns how many are pending."""
        p = dedup_positions(positions.detach().cpu(), self.budget)
        with self.lock:
            self.pending[rid] = p
        return int(p.numel())

    def drop(self, rid: str) -> None:
        with self.lock:
            self.pending.pop(rid, None)

    def publish(self, rids: list[str]) -> int:
        """Take each row's next W pending positions into `pf_pos` (rows in batch order) and set `pf_active`;
        returns the rows published (0 = no hint this forward). Runs on the caller's (the forward's) stream."""
        if self.pf_pos is None:
            return 0
        rows = min(len(rids), self.pf_pos.shape[0])
        host = torch.full((rows, self.width), -1, dtype=torch.int32)
        with self.lock:
            for b, rid in enumerate(rids[:rows]):
                q = self.pending.get(rid)
                if q is None or q.numel() == 0:
                    continue
                take, rest = q[: self.width], q[self.width :]
                host[b, : take.numel()] = take.to(torch.int32)
                if rest.numel():
                    self.pending[rid] = rest
                else:
                    del self.pending[rid]
        self.active = rows if bool((host >= 0).any()) else 0
        if self.active:
            self.pf_pos[:rows].copy_(host.to(self.pf_pos.device), non_blocking=True)
        self.pf_active.fill_(self.active)
        return self.active


def state() -> PrefetchState:
    """The mode's process state (`RUNTIME.hisparse.prefetch`), created on first use."""
    if RUNTIME.hisparse.prefetch is None:
        RUNTIME.hisparse.prefetch = PrefetchState()
    return RUNTIME.hisparse.prefetch


def resident_hint(pages: torch.Tensor, n_entries: int, tail: int, page_chunks: int = 64) -> torch.Tensor:
    """Int64 positions for `set_hint` from a Level-1 resident set: `pages` (int [P] page ids in priority order,
    -1 = none) expanded to their c4 positions, page by page, keeping only positions below n_entries - max(tail, 1)
    (the recency tail is mostly resident already, and the newest entry lives in the reserved slot)."""
    p = pages.reshape(-1).to(torch.int64)
    p = p[p >= 0]
    pos = (p[:, None] * page_chunks + torch.arange(page_chunks, dtype=torch.int64)).reshape(-1)
    return pos[pos < n_entries - max(tail, 1)]
