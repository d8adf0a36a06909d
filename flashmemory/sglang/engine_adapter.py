"""The offload core (`flashmemory.offload.OffloadEngine` + `Level1` + `Level2`) behind sglang's DSv4 c4 pool.

Address spaces (one c4 layer; every c4 layer shares them):
  pool loc   page * 64 + off in sglang's c4 pool (`pool.c4_kv_pool.kv_buffer[l]`: uint8 [n_pages, 37440],
             page = [64 x 576 nope+rope | 64 x 8 scales] padded to 576; index-K `pool.c4_indexer_kv_pool.
             index_k_with_scale_buffer[l]`: uint8 [n_pages, 8448] = [64 x 128 fp8 | 64 x fp32 scale]).
  mirror chunk  the core's key (mirror page * 64 + off); the core allocates mirror pages itself here (copy
             mode); in shrink mode (`shrink.py`) mirror pages are pool pages.
  cell       reserve block * 64 + off: what attention reads through `reserve_kv(l)` instead of the pool.
`loc2m` Int64 [n_locs + 1] maps pool loc -> mirror chunk (the core's LUT sentinel where unknown; the last
entry is a sentinel too), so `cells_of(locs) = lut.table[loc2m[locs]]`: two gathers, static tensors,
CUDA-graph safe. Request lifecycle is synced once per decode forward (`begin_step`): new requests are
admitted with their history copied from the pool, vanished ones finished, new chunks appended (their bytes
land per layer via `on_c4_store` and are settled from the pool for all layers at the next step).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload import OffloadEngine
from flashmemory.residency.level1 import Level1, retriever_scorer, warm_start
from flashmemory.residency.policy import ThresholdPagePolicy
from flashmemory.sglang.core_config import core_config
# Geometry lives in its own module; re-exported because callers and tests know it from here.
from flashmemory.sglang.geometry import (RATIO, PoolGeometry, PoolGeometryError, c4_counts, page_locs,  # noqa: F401
                                         pool_buffers, read_chunk_rows, read_geometry)
from flashmemory.sglang.miss_monitor import build_monitor, monitor_stats



class _AllPass:
    """Level-1 scorer without a retriever: every chunk passes, so the policy keeps the newest KMAX pages."""

    def __call__(self, row: int, n_hist: int, hidden: Any, position: torch.Tensor) -> torch.Tensor:
        return torch.ones(n_hist)


class SGLangOffload:
    """What `flashmemory.sglang.runtime` drives: every method the hooks and runtime call, copy mode's behaviour
    (no-ops for what only shrink mode does; `shrink.ShrunkOffload` overrides them). Build it with
    `adapter_factory.build(pool, env)` (copy mode here, shrink mode in `shrink.ShrunkOffload`)."""

    def __init__(self, pool: Any, env: FlashMemoryEnv, retriever: Any = None, device: torch.device | str | None = None):
        self.pool, self.env = pool, env
        self.geo = geo = read_geometry(pool)
        self.kv_bufs, self.ix_bufs = pool_buffers(pool)
        bad = [l for l in env.retriever_layers if l >= geo.n_c4_layers]
        if bad:
            raise PoolGeometryError(f"SGLANG_RETRIEVER_INLINE_LAYERS {list(env.retriever_layers)}: the pool has "
                                    f"{geo.n_c4_layers} c4 layers; {bad} do not exist")
        self.device = torch.device(device) if device is not None else self.kv_bufs[0].device
        # The env stops here: the core takes the typed configs made from it in one function.
        self.core = core_config(env, geo, landing_blocks=self._landing_blocks())
        self.layout, self.cfg, self.level1_cfg = self.core.layout, self.core.engine, self.core.level1
        self.engine = OffloadEngine(self.layout, self.cfg, self.device, target_buffers=self._target_buffers())
        scorer = retriever_scorer(retriever, self.engine, self.core.ensemble) if retriever is not None else _AllPass()
        self.indexers: dict[int, Any] = {}   # target c4 layer -> sglang's C4Indexer (filled by the runtime's hook)
        self.monitor = build_monitor(self.core.escalation, self.engine, lambda: self.indexers)
        self.l1 = Level1(self.engine, scorer, ThresholdPagePolicy(self.core.selection), self.level1_cfg,
                         monitor=self.monitor)
        self._kv_byte_map = self.layout.kv.byte_map.to(self.device)   # device copy: no H2D copy under capture
        self.loc2m = torch.full((geo.n_locs + 1,), self.engine.lut.sentinel, dtype=torch.int64, device=self.device)
        self.rows: dict[str, int] = {}             # rid -> engine row
        self.pages: dict[int, list[int]] = {}      # engine row -> pool pages (logical page order)
        self._mapped: dict[int, list[int]] = {}    # engine row -> pool pages whose loc2m entries are written
        self.step_rows = torch.full((0,), -1, dtype=torch.int64)
        self._unsettled: list[torch.Tensor] = []   # pool locs appended last step: re-read from the pool next step

    mode = "copy"  # the device pool stays complete; the mirror and reserve are copies (see shrink.ShrunkOffload)
    # An extend forward's c4 attention reads the reserve (shrink mode): the runtime counts such forwards.
    extend_reads_reserve = False

    def _landing_blocks(self) -> int:
        """Reserve scratch blocks for extend stores (none in copy mode: the pool stays complete)."""
        return 0

    def _target_buffers(self) -> list[torch.Tensor] | None:
        return None

    # --- what runtime reads ----------------------------------------------------------------------
    @property
    def lut(self) -> torch.Tensor:
        """Int32 [n_locs + 1]: pool loc -> reserve cell, -1 = not resident (last entry -1)."""
        return self.engine.lut.table[self.loc2m]

    @property
    def resident_mask(self) -> torch.Tensor:
        """Bool [n_locs]: pool loc is resident (mask mode)."""
        return self.engine.lut.table[self.loc2m[:-1]] >= 0

    def cells_of(self, locs: torch.Tensor) -> torch.Tensor:
        """Top-k pool locs [B, K] (-1 empty) -> reserve cells [B, K] int32, -1 where not resident. Graph safe."""
        n = self.geo.n_locs
        idx = torch.where((locs >= 0) & (locs < n), locs.long(), torch.full_like(locs, n, dtype=torch.long))
        return self.engine.lut.table[self.loc2m[idx]].to(torch.int32)

    def refresh_from_pool(self, layer: int, locs: torch.Tensor) -> None:
        """Copy the c4 entries at pool locs [T] (this step's `c4_out_loc`) from the pool into their reserve cells.

        Graph safe: static shapes, device-only index math, no host sync. Locs that are not resident (or are
        padding) write to the reserve's sink cell; duplicate resident locs copy identical bytes."""
        n, pc = self.geo.n_locs, self.geo.page_chunks
        locs = locs.reshape(-1).long()
        ok = (locs >= 0) & (locs < n)
        src = torch.where(ok, locs, torch.zeros_like(locs))
        cells = self.engine.lut.table[self.loc2m[torch.where(ok, locs, torch.full_like(locs, n))]].long()
        cells = torch.where(cells >= 0, cells, torch.full_like(cells, self.engine.reserve.sink_cell))
        fmt, bm = self.layout.kv, self._kv_byte_map
        src_idx = (src // pc).unsqueeze(1) * fmt.page_bytes + bm[src % pc]
        dst_idx = (cells // pc).unsqueeze(1) * fmt.page_bytes + bm[cells % pc]
        dst = self.engine.reserve.kv[layer].view(-1)
        dst[dst_idx.reshape(-1)] = self.kv_bufs[layer].view(-1)[src_idx.reshape(-1)]

    def reserve_kv(self, layer: int) -> torch.Tensor:
        return self.engine.reserve.kv[layer]

    def reserve_index(self, layer: int) -> torch.Tensor | None:
        # The indexer addresses index-K by pool page table, not by reserve block, so handing it the Path-I
        # reserve would score the wrong bytes; reads stay on the (still complete) device pool for now.
        return None

    def mirror_buf_infos(self) -> dict[int, tuple[int, int, int]]:
        # The core allocates mirror pages itself, so PD cannot receive straight into the mirror; it receives
        # into the device pool as stock sglang does and `begin_step` copies each new request's history.
        return {}

    # --- what shrink mode adds (no-ops here, so callers never probe for them) -------------------------
    def index_in_reserve(self, layer: int | None) -> bool:
        """c4 layer `layer`'s index-K lives in the Path-I reserve (never in copy mode)."""
        return False

    def block_table(self, pages: torch.Tensor) -> torch.Tensor:
        """Pool pages [B, K] -> reserve blocks; only for layers with `index_in_reserve` (none in copy mode)."""
        raise RuntimeError("copy mode keeps no index-K in the reserve (index_in_reserve is False for every layer)")

    def drop_sink(self, cells: torch.Tensor) -> torch.Tensor:
        """Top-k picks [B, K] with the sink block's removed (copy mode has no reserve-block picks: unchanged)."""
        return cells

    def begin_forward(self, is_decode: bool) -> None:
        """Before any non-idle forward: where its c4 stores land (copy mode: sglang's pool, nothing to do)."""

    def end_extend(self) -> None:
        """After an extend forward (copy mode: its stores are in sglang's pool, read at admission)."""

    def settle(self) -> None:
        """After a decode forward (copy mode: this step's entries are re-read from the pool at `begin_step`)."""

    def host_ptrs(self) -> set[int]:
        """Mirror pointers NIXL must register as host DRAM (copy mode: none; PD lands in the device pool)."""
        return set()

    # --- lifecycle ---------------------------------------------------------------------------------
    def _map_pages(self, row: int) -> None:
        """loc2m entries for the logical pages of `row` that have a mirror page and are not mapped yet (one indexed
        write; pages map once, so a step costs nothing for rows whose page list did not grow)."""
        pools, mirrors = self.pages[row], self.engine.rows[row].mpages
        done = self._mapped.get(row, [])
        n = min(len(pools), len(mirrors))
        if pools[:len(done)] != done:   # the pool pages moved under the request: map everything again
            self._unmap_pages(done)
            done = []
        if n > len(done):
            pc = self.geo.page_chunks
            off = torch.arange(pc)
            src = (torch.tensor(pools[len(done):n]).unsqueeze(1) * pc + off).reshape(-1)
            dst = (torch.tensor(mirrors[len(done):n]).unsqueeze(1) * pc + off).reshape(-1)
            self.loc2m[src.to(self.device)] = dst.to(self.device)
            done = pools[:n]
        self._mapped[row] = list(done)

    def _unmap_pages(self, pages: list[int]) -> None:
        if pages:
            pc = self.geo.page_chunks
            idx = (torch.tensor(pages).unsqueeze(1) * pc + torch.arange(pc)).reshape(-1)
            self.loc2m[idx.to(self.device)] = self.engine.lut.sentinel

    def _unmap(self, row: int) -> None:
        self.pages.pop(row, None)
        self._unmap_pages(self._mapped.pop(row, []))

    def _free_row(self) -> int:
        used = set(self.rows.values())
        for r in range(self.cfg.max_rows):
            if r not in used and self.engine.rows[r] is None:
                return r
        raise RuntimeError(f"Path-P: more than SGLANG_PATHP_DECODE_MAX_CONC={self.cfg.max_rows} concurrent requests")

    def _settle(self) -> None:
        """Re-read last step's appended chunks from the pool for every layer (mirror, reserve, target index)."""
        if not self._unsettled:
            return
        locs = torch.cat(self._unsettled)
        self._unsettled = []
        self._copy_from_pool(locs, range(self.geo.n_c4_layers), kv=True, index=True)

    def begin_step(self, rids: Sequence[str], page_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Sync requests before a decode forward. page_table: [B, P] c4 pool pages; seq_lens: [B] tokens with the
        current one. Returns engine rows [B] (-1: no c4 history yet). Vanished requests are finished, new ones
        admitted (`_admit`) with their newest KMAX pages resident (`warm_start`), and each row's history is
        extended to the chunks this step closes (`_new_chunks`)."""
        self._settle()
        before, after = c4_counts(seq_lens.cpu())
        live = set(rids)
        for rid in [r for r in self.rows if r not in live]:
            row = self.rows.pop(rid)
            self.engine.finish(row)
            self._unmap(row)
        pt = page_table.cpu().long()
        pc, rows = self.geo.page_chunks, []
        for b, rid in enumerate(rids):
            pages = pt[b, :-(-int(after[b]) // pc)].tolist()
            row = self.rows.get(rid)
            if row is None and int(before[b]) >= 1:
                row = self._free_row()
                self._admit(row, rid, pages, int(before[b]))
                self.engine.open_tail_page(row)   # the newest page is readable from the first step on
                warm_start(self.engine, row, self.level1_cfg.max_resident_pages)  # older pages until cycle 1
                self.rows[rid] = row
            if row is not None:
                self._grow(row, rid, pages)
                self.pages[row] = pages
                self._map_pages(row)
            rows.append(-1 if row is None else row)
        while True:  # one chunk per lagging row and call, until every row reaches `after`
            lag = [(b, r) for b, r in enumerate(rows) if r >= 0 and self.engine.n_chunks(r) < int(after[b])]
            if not lag:
                break
            locs = torch.tensor([int(pt[b, self.engine.n_chunks(r) // pc]) * pc + self.engine.n_chunks(r) % pc
                                 for b, r in lag], dtype=torch.int64)
            self._new_chunks([r for _, r in lag], locs)
        self.step_rows = torch.tensor(rows, dtype=torch.int64)
        return self.step_rows

    def _admit(self, row: int, rid: str, pages: list[int], n: int) -> None:
        """Copy mode: the first n chunks of the request, read from sglang's pool, into mirror pages of our own."""
        locs = page_locs(pages, 0, n, self.geo.page_chunks)
        kv = read_chunk_rows(self.layout.kv, self.kv_bufs, locs)
        ix = read_chunk_rows(self.layout.index, self.ix_bufs, locs)
        self.engine.admit(row, kv, ix, rid=rid)

    def _grow(self, row: int, rid: str, pages: list[int]) -> None:
        """Copy mode: nothing (the engine allocates its own mirror pages as the history grows)."""

    def _new_chunks(self, rows: list[int], locs: torch.Tensor) -> None:
        """Copy mode: append the chunks at pool locs [n] with the pool's current bytes; sglang stores them during
        this forward, so they are read again from the pool at the next step (`_settle`)."""
        kv = read_chunk_rows(self.layout.kv, self.kv_bufs, locs)
        ix = read_chunk_rows(self.layout.index, self.ix_bufs, locs)
        self.engine.decode_append(rows, kv, ix)
        for r in rows:
            self._map_pages(r)
        self._unsettled.append(locs)

    # --- per-layer stores (sglang wrote these locs of the pool) ------------------------------------
    def _copy_from_pool(self, locs: torch.Tensor, layers: Sequence[int], kv: bool, index: bool) -> None:
        eng, pc = self.engine, self.geo.page_chunks
        locs = locs.to(self.device).long()
        m = self.loc2m[locs.clamp(0, self.geo.n_locs)]
        ok = (locs >= 0) & (locs < self.geo.n_locs) & (m != eng.lut.sentinel)
        if not bool(ok.any()):
            return
        locs, m = locs[ok], m[ok]
        layers = list(layers)
        every = layers == list(range(self.geo.n_c4_layers))
        with eng.lock:
            cells = eng.lut.table[m].long()
            res = cells >= 0
            if kv:  # one gather per pool layer (separate tensors), one scatter into the mirror and the reserve
                rows = read_chunk_rows(self.layout.kv, self.kv_bufs, locs, layers)          # [len(layers), n, 584]
                mr, mo = (m // pc).cpu(), (m % pc).cpu()
                hit = bool(res.any())
                if hit:
                    rc, rr, rrows = cells[res] // pc, cells[res] % pc, rows[:, res.cpu()].to(self.device)
                for j, l in enumerate(layers if not every else [None]):
                    sel = slice(None) if every else slice(j, j + 1)
                    self.layout.kv.write_chunks(eng.mirror.kv if every else eng.mirror.kv[l:l + 1], mr, mo, rows[sel])
                    if hit:
                        self.layout.kv.write_chunks(eng.reserve.kv if every else eng.reserve.kv[l:l + 1], rc, rr, rrows[sel])
            if index:
                for l in layers:
                    self._copy_index(l, locs, m, cells, res)

    def _copy_index(self, l: int, locs: torch.Tensor, m: torch.Tensor, cells: torch.Tensor, res: torch.Tensor) -> None:
        eng, lay, pc = self.engine, self.layout, self.geo.page_chunks
        rows = read_chunk_rows(lay.index, self.ix_bufs, locs, [l])[0]
        if l in lay.target_layers:
            buf = eng.target.pages[eng.target.layers.index(l)]
            lay.index.write_chunks(buf, (m // pc).to(buf.device), (m % pc).to(buf.device), rows.to(buf.device))
        elif l in lay.offload_index_layers:
            i = lay.offload_index_layers.index(l)
            lay.index.write_chunks(eng.mirror.index[i], (m // pc).cpu(), (m % pc).cpu(), rows)
            if bool(res.any()):
                lay.index.write_chunks(eng.reserve.index[i], cells[res] // pc, cells[res] % pc, rows[res.cpu()].to(self.device))

    def on_c4_store(self, layer: int, locs: torch.Tensor) -> None:
        """Layer `layer` of the pool was written at `locs`: mirror it, and into the reserve where resident."""
        self._copy_from_pool(locs.reshape(-1), [layer], kv=True, index=False)

    def on_index_store(self, layer: int, locs: torch.Tensor) -> None:
        self._copy_from_pool(locs.reshape(-1), [layer], kv=False, index=True)

    # --- Level 1 / Level 2 -------------------------------------------------------------------------
    def level1(self, snapshot: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One decode step's Level-1 call (cadence and async are Level1's). snapshot: hidden_{layer} [B, hidden]
        for the target layers (absent without a retriever), positions [B]. Returns {"pages": [B, res_cap]}.

        The tensors may be views of the runtime's static side band: `Level1.on_step` copies the due rows
        (index_select + clone) on the caller's stream, so the next forward may overwrite them. A snapshot
        shorter than the batch (side band capacity) leaves the rows beyond it out of this step's cycle."""
        rows = self.step_rows
        n = rows.numel()
        if "positions" in snapshot:
            n = min(n, snapshot["positions"].shape[0])
        if n and bool((rows[:n] >= 0).any()):
            hidden: dict[Any, torch.Tensor] = {l: snapshot[f"hidden_{l}"][:n] for l in self.layout.target_layers
                                               if f"hidden_{l}" in snapshot}
            hidden.update({("q_lora", l): snapshot[f"q_lora_{l}"][:n] for l in self.layout.target_layers
                           if f"q_lora_{l}" in snapshot})   # the miss monitor's native query input
            positions = snapshot.get("positions", torch.zeros(n, dtype=torch.int64))[:n]
            self.l1.on_step(rows[:n].tolist(), hidden, positions)
        return {"pages": self.resident_pages(rows)}

    def resident_pages(self, rows: torch.Tensor) -> torch.Tensor:
        """Int64 [B, kmax + decode_pages] resident logical pages per row, ascending, -1 padded (-1 rows: all -1)."""
        r = rows.to(self.device).long()
        with self.engine.lock:
            p = self.engine.res_pages[r.clamp_min(0)].long()
        return torch.where(r.unsqueeze(1) >= 0, p, torch.full_like(p, -1))

    def stats(self) -> dict[str, float]:
        """The keys of `flashmemory.sglang.prometheus.METRICS`."""
        snap = self.engine.metrics()["total"]
        eng = self.engine
        with eng.lock:
            hist = sum(st.n_chunks for st in eng.rows if st is not None)
        rb = eng.reserve.recall_blocks
        return {"recall_bytes": float(snap["recall_bytes"]), "recall_pages": float(snap["recall_pages"]),
                "warm_start_pages": float(snap["warm_start_pages"]),
                "level1_cycles": float(snap["cycles"]),
                "resident_fraction": snap["resident_chunks"] / hist if hist else 0.0,
                "reserve_used_fraction": (rb - snap["free_blocks"]) / rb,
                "level1_cycle_seconds": float(snap["last_cycle"]["latency_s"]), "device_bytes_saved": 0.0,
                **self._monitor_stats(snap)}

    def _monitor_stats(self, snap: dict[str, Any]) -> dict[str, Any]:
        if self.monitor is None:
            return {}
        with self.engine.lock:
            recent = list(self.engine.stats.miss_recent)
        return monitor_stats(snap, recent)

    def close(self) -> None:
        self.l1.close()
