"""Per-request row state and the compact resident tables, shared by the engine (lifecycle) and the recaller.

Both `OffloadEngine` and `flashmemory.offload.recall.Recaller` are handed the same `RowState` list and the same
`ResidentTables`; every read or write of either happens under the engine's lock (`threading.RLock`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from flashmemory.offload import streams
from flashmemory.offload.counters import ResidencyCounts
from flashmemory.offload.reserve import DeviceReserve
from flashmemory.offload.streams import ForwardOrder


@dataclass
class RowState:
    """One admitted request. Invariants: `mpages[p]` is the mirror page of logical page p; a page is in at most
    one of `recall` (published recall block) and `ring` (decode slot -> page, -1 = empty); `gen` is unique per
    admission, so work planned for an older occupant of the row is recognised."""

    rid: Hashable
    gen: int
    mpages: list[int]  # logical page -> mirror page
    n_chunks: int
    recall: dict[int, int] = field(default_factory=dict)  # logical page -> recall block (published)
    ring: list[int] = field(default_factory=list)  # decode slot -> logical page, -1 = empty
    ring_next: int = 0
    selection: frozenset[int] = frozenset()  # latest Level-1 selection: protected from eviction
    planned: bool = False  # a Level-1 cycle's plan has published for this request (the warm start is not one)


class ResidentTables:
    """Compact per-row table of resident pages (ascending logical page), for score-resident Level 2.

    pages / blocks / mpages: int32 [max_rows, res_cap] (-1 padded); count: int32 [max_rows]. res_cap =
    max_resident_pages + decode_pages. Allocated once on the reserve's device; rewritten in place (index_copy_),
    so tensors handed out earlier (and a CUDA graph that recorded them) stay valid. Written on the forward stream
    `order.stream` (the stream decode reads them from, handed in per step).
    """

    def __init__(
        self,
        rows: list[RowState | None],
        reserve: DeviceReserve,
        res_cap: int,
        order: ForwardOrder,
        counts: ResidencyCounts | None = None,
    ):
        """counts: running residency totals, told each rebuilt row's resident pages (the metrics read them)."""
        self.rows, self.reserve, self.res_cap, self.order = rows, reserve, res_cap, order
        self.counts = counts
        n, dev = len(rows), reserve.device
        mk = lambda: torch.full((n, res_cap), -1, dtype=torch.int32, device=dev)  # noqa: E731
        self.pages, self.blocks, self.mpages = mk(), mk(), mk()
        self.count = torch.zeros(n, dtype=torch.int32, device=dev)

    def rebuild(self, rows: Iterable[int]) -> None:
        """Rewrite the tables of `rows` (recalled + decode-region pages, ascending page) in one indexed copy per
        table. Call under the engine's lock."""
        rows = sorted(set(rows))
        if not rows:
            return
        table: list[list[list[int]]] = []
        counts: list[int] = []
        for row in rows:
            st = self.rows[row]
            items = (
                []
                if st is None
                else sorted(
                    list(st.recall.items())
                    + [(p, self.reserve.decode_block(row, s)) for s, p in enumerate(st.ring) if p >= 0]
                )
            )
            if len(items) > self.res_cap:
                raise RuntimeError(f"row {row}: {len(items)} resident pages exceed the compact table ({self.res_cap})")
            pad = [-1] * (self.res_cap - len(items))
            table.append(
                [[p for p, _ in items] + pad, [b for _, b in items] + pad, [st.mpages[p] for p, _ in items] + pad]
            )
            counts.append(len(items))
            if self.counts is not None:
                self.counts.set_row(row, [p for p, _ in items], 0 if st is None else st.n_chunks)
        with self.order.on_stream():  # the uploads too (pinned, async): on the stream decode reads the tables from
            buf = streams.like(torch.tensor(table, dtype=torch.int32), self.pages)  # [n, 3, res_cap]
            idx = streams.like(torch.tensor(rows, dtype=torch.int64), self.pages)
            self.pages.index_copy_(0, idx, buf[:, 0])
            self.blocks.index_copy_(0, idx, buf[:, 1])
            self.mpages.index_copy_(0, idx, buf[:, 2])
            self.count.index_copy_(0, idx, streams.like(torch.tensor(counts, dtype=torch.int32), self.count))
