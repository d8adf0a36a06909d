"""Copy mode: `CopyAdapter`, the `OffloadAdapter` that leaves sglang's c4 pool complete.

The core allocates mirror pages of its own; a new request's history is copied from the pool at admission, each
step's new chunks are appended as cells and read from the pool for every layer at the next step, on the device
(`settle_before_step`: sglang stores them during the forward; the core writes them into the resident cells and
the target index pool there and into the mirror through pinned staging, `OffloadEngine.stage_chunks`, with no
host wait), and before attention this step's entries are copied pool -> reserve cells (`refresh_from_pool`), so
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
    pool_before_plan = True  # the pool holds every page: a request attends all of it until its first plan

    def __init__(self, pool: Any, env: FlashMemoryEnv, retriever: Any = None, device: torch.device | str | None = None):
        super().__init__(pool, env, retriever, device)
        self._kv_byte_map = self.layout.kv.byte_map_like(self._storage.reserve_kv)  # on the device: none under capture
        # Chunks appended last step, read from the pool next step: (engine rows [n], pool locs [n], mirror chunks [n])
        self._unsettled: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        self._round_rows: list[list[int]] = []  # engine rows of this step's append rounds (`_append_round`)

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
        """Last step's appended chunks read from the pool for every layer on the device, for this step's
        `sync_batch` to stage first (`ChunkStore.rows`: `stage_chunks`, resident cells and target index now, the
        mirror once its pinned copy is complete); the host reads nothing back."""
        self._round_rows = []
        if not self._unsettled:
            return None
        rows = [r for rr, _, _ in self._unsettled for r in rr]
        locs = torch.cat([t for _, t, _ in self._unsettled])
        m = torch.cat([t for _, _, t in self._unsettled])
        self._unsettled = []
        lay = self.layout
        kv = read_chunk_rows(lay.kv, self.kv_bufs, locs, host=False)
        kept = set(lay.target_layers) | set(lay.offload_index_layers)
        index = [
            read_chunk_rows(lay.index, self.ix_bufs, locs, [l], host=False)[0] if l in kept else None
            for l in range(self.geo.n_c4_layers)
        ]
        return ChunkStore(m, tuple(range(self.geo.n_c4_layers)), kv, tuple(index), rows=tuple(rows))

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
        self._round_rows.append(list(rows))
        return AppendRound(tuple(rows))

    def _appended(self, locs: list[torch.Tensor], cells: Sequence[torch.Tensor]) -> None:
        """Each round's chunks with their mirror chunks, from the adapter's own view of the rows' pool and mirror
        pages (as the sync reported them): the next step settles them without reading the device."""
        pc = self.geo.page_chunks
        for rows, lt in zip(self._round_rows, locs):
            keep, m = [], []
            for i, (row, loc) in enumerate(zip(rows, lt.tolist())):
                pages, mp = self.pages.get(row, []), self.mpages.get(row, ())
                k = pages.index(loc // pc) if loc // pc in pages else len(mp)
                if k < len(mp):
                    keep.append(i)
                    m.append(mp[k] * pc + loc % pc)
            if keep:
                sel = torch.tensor(keep, dtype=torch.int64)
                self._unsettled.append(([rows[i] for i in keep], lt[sel], torch.tensor(m, dtype=torch.int64)))
        self._round_rows = []
