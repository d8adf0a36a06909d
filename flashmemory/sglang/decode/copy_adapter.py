"""Copy mode: `CopyAdapter`, the `OffloadAdapter` that leaves sglang's c4 pool complete.

The core allocates mirror pages of its own; a new request's history is copied from the pool at admission, each
step's new chunks are appended with the pool's current bytes and re-read from the pool for every layer at the
next step (`settle_before_step`, stored first by that step's `sync_batch`: sglang stores them during the
forward), and before attention this step's entries are copied pool -> reserve cells (`refresh_from_pool`), so
attention can read the reserve. It saves no device memory; shrink mode (`shrink_adapter.ShrinkAdapter`) does. Shared
behaviour and the protocol with its no-op defaults live in `offload_adapter.OffloadAdapter`;
`adapter_factory.build` picks the mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload.sync import Admission, AppendRound, ChunkStore

# Geometry lives in its own module; re-exported because callers and tests know it from here.
from flashmemory.sglang.decode.geometry import (  # noqa: F401
    RATIO,
    PoolGeometry,
    PoolGeometryError,
    c4_counts,
    page_locs,
    pool_buffers,
    read_chunk_rows,
    read_geometry,
)
from flashmemory.sglang.decode.offload_adapter import AllPass, OffloadAdapter  # noqa: F401


class CopyAdapter(OffloadAdapter):
    """Copy mode: sglang's c4 pool stays complete; the mirror and reserve hold copies of its pages."""

    mode = (
        "copy"  # the device pool stays complete; the mirror and reserve are copies (see shrink_adapter.ShrinkAdapter)
    )

    def __init__(self, pool: Any, env: FlashMemoryEnv, retriever: Any = None, device: torch.device | str | None = None):
        super().__init__(pool, env, retriever, device)
        self._kv_byte_map = self.layout.kv.byte_map_like(self._storage.reserve_kv)  # on the device: none under capture
        self._unsettled: list[torch.Tensor] = []  # pool locs appended last step: re-read from the pool next step

    def refresh_from_pool(self, layer: int, locs: torch.Tensor) -> None:
        """Copy the c4 entries at pool locs [T] (this step's `c4_out_loc`) from the pool into their reserve cells.

        Graph safe: static shapes, device-only index math, no host sync. Locs that are not resident (or are
        padding) write to the reserve's sink cell; duplicate resident locs copy identical bytes."""
        n, pc = self.geo.n_locs, self.geo.page_chunks
        locs = locs.reshape(-1).long()
        ok = (locs >= 0) & (locs < n)
        src = torch.where(ok, locs, torch.zeros_like(locs))
        m = self.loc2m[torch.where(ok, locs, torch.full_like(locs, n))]  # the core's no_chunk where unknown
        src_bytes = (src // pc).unsqueeze(1) * self.layout.kv.page_bytes + self._kv_byte_map[src % pc]
        self.engine.refresh_cells(layer, m, self.kv_bufs[layer], src_bytes, self._kv_byte_map)

    def on_c4_store(self, layer: int, locs: torch.Tensor) -> None:
        """Layer `layer` of the pool was written at `locs`: mirror it, and into the reserve where resident."""
        self._copy_from_pool(locs.reshape(-1), [layer], kv=True, index=False)

    def settle_before_step(self) -> ChunkStore | None:
        """Last step's appended chunks re-read from the pool for every layer, for the core to store first in this
        step's `sync_batch` (mirror, reserve where resident, target index)."""
        if not self._unsettled:
            return None
        locs = torch.cat(self._unsettled)
        self._unsettled = []
        return self._pool_chunks(locs, range(self.geo.n_c4_layers), kv=True, index=True)

    def _mirror_pages_needed(self, n_chunks: int) -> int:
        return self.layout.pages_for(n_chunks)

    def _admission(self, row: int, rid: str, pages: list[int], n: int) -> Admission:
        """The first n chunks of the request, gathered from sglang's pool on its device (no host wait): the core
        warms the request from these rows device to device and copies them into mirror pages of its own through
        pinned staging (`flashmemory.offload.landing`)."""
        locs = page_locs(pages, 0, n, self.geo.page_chunks)
        kv = read_chunk_rows(self.layout.kv, self.kv_bufs, locs, host=False)
        ix = read_chunk_rows(self.layout.index, self.ix_bufs, locs, host=False)
        return Admission(row, rid, n, kv=kv, index=ix, warm_pages=self.level1_cfg.max_resident_pages)

    def _append_round(self, rows: list[int], locs: torch.Tensor) -> AppendRound:
        """One chunk per row at pool locs [n]: cells only. sglang stores the bytes during this forward, so the
        pool holds nothing to read yet: `refresh_from_pool` copies them into the cells before attention, and the
        next step's `settle_before_step` reads them into the mirror and the target index pool."""
        return AppendRound(tuple(rows))

    def _appended(self, locs: list[torch.Tensor], cells: Sequence[torch.Tensor]) -> None:
        self._unsettled.extend(locs)
