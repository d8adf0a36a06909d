"""What page recall works on and hands around: `RecallState` (the engine's parts the `Recaller` shares), the
`RecallRequest` Level 1 computes, the `RecallPlan` a recall fills, and the `PageSource` that may copy a plan.

`RecallState` is built once by the engine (`OffloadEngine.__init__`) from its own objects and handed to its
`Recaller` as its one reference to the engine's state: the lists, sets and tables in it are mutated in place and
never rebound, so the engine and the recaller always see the same state; only `lock` may be swapped (a bench
wraps it to time holds), through the engine's `lock` setter. Every field is guarded by `lock`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from flashmemory.offload.counters import OffloadMetrics
from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.lru import PageLRU
from flashmemory.offload.lut import ChunkLUT
from flashmemory.offload.mirror import HostMirror
from flashmemory.offload.reserve import BlockAllocator, DeviceReserve
from flashmemory.offload.rows import ResidentTables, RowState
from flashmemory.offload.streams import ForwardOrder


@dataclass(eq=False)
class RecallState:
    """The engine's parts recall plans, copies and publishes over (shared by reference with the engine).

    rows: request row -> its state (None: free); owner: recall block -> (row, gen, logical page) or None;
    inflight: blocks planned and not yet published; blocks: the free recall blocks; lru: published blocks by
    last use; lut: mirror chunk -> reserve cell; mirror / reserve: where bytes come from / go to; tables: the
    per-row resident tables; stats: counters; lock: guards all of the above (an RLock unless swapped); order:
    the forward stream and gate (table writes go between forwards)."""

    layout: OffloadLayout
    max_resident_pages: int  # per-request cap on recalled pages (KMAX)
    rows: list[RowState | None]
    owner: list[tuple[int, int, int] | None]
    inflight: set[int]
    blocks: BlockAllocator
    lru: PageLRU
    lut: ChunkLUT
    mirror: HostMirror
    reserve: DeviceReserve
    tables: ResidentTables
    stats: OffloadMetrics
    order: ForwardOrder
    lock: Any = field(default_factory=threading.RLock)
    # called with the rows of a plan before their mirror pages are read (the lock not held): pending lands first
    before_read: Any = None


@dataclass(frozen=True)
class RecallRequest:
    """One request's Level-1 result. pages: logical pages; priority: same length, higher = keep first
    (use +inf for the recency tail). budget: this request's page cap for this cycle (escalation widens and
    shrinks it), at most the engine's `max_resident_pages`; None = the engine's cap. Recalled pages beyond it
    that the selection no longer holds are evicted, so a shrunk budget really gives its blocks back."""

    row: int
    gen: int
    pages: tuple[int, ...]
    priority: tuple[float, ...]
    budget: int | None = None

    def __post_init__(self) -> None:
        if len(self.pages) != len(self.priority):
            raise ValueError(
                f"RecallRequest(row={self.row}): {len(self.pages)} pages but {len(self.priority)} priorities"
            )
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"RecallRequest(row={self.row}): budget must be >= 1, got {self.budget}")


@dataclass
class RecallPlan:
    """entries: (row, gen, page, mirror page, block) to copy. Filled by `Recaller.plan`."""

    entries: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    t0: float = 0.0
    nbytes: int = 0
    staging: list[torch.Tensor] = field(default_factory=list)
    error: BaseException | None = None  # a request's failure found by the copy, raised by `recall` after publish
    ready: Any = None  # CUDA event after an unwaited copy (`copy(wait=False)`): the publish's stream waits on it
    cycle: tuple[tuple[int, int], ...] = ()  # (row, gen) of a Level-1 cycle's requests: marked planned at publish


class PageSource(Protocol):
    """Copies a plan's pages into the reserve in place of the mirror gather (`Recaller.source`). It may drop
    entries (cancelled, blocks freed) and set `plan.error` for their request; the rest must be copied. wait=False:
    as `Recaller.copy`'s (no host wait for the device copy: fresh pinned staging, `plan.ready` marks it)."""

    def copy_plan(self, plan: RecallPlan, wait: bool = True) -> None: ...
