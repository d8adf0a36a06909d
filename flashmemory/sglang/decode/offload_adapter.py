"""`OffloadAdapter`: the offload core (`OffloadEngine` + `Level1`) behind sglang's DSv4 c4 pool, mode-neutral.

The base class carries the complete protocol the hooks (`hooks.py`) and the runtime (`runtime.py`) call, with
no-op defaults where a mode has nothing to do, so no caller probes what an adapter can do. Its two modes
subclass it: `copy_adapter.CopyAdapter` (copy mode: sglang's pool stays complete, mirror and reserve are
copies) and `shrink_adapter.ShrinkAdapter` (shrink mode: the device c4 pool becomes the reserve).
`adapter_factory.build` picks one.

Address spaces: sglang's pool locs, the core's mirror chunks and reserve cells (`loc_map`). `loc2m` maps pool
loc -> mirror chunk, so `cells_of(locs) = cell_table[loc2m[locs]]`: two gathers, static tensors, graph safe.

The adapter names no part of the core (its mirror, reserve, lookup table, lock, ...): it calls the core's verbs
(`OffloadEngine` and `offload.access.CoreAccess`) in the core's addresses, and the core takes its lock inside
them (tests/sglang/test_core_boundary.py checks it).

Once per decode forward `begin_step` describes the step's lifecycle (finished rows, admissions, added pages,
append rounds) as one `offload.sync.BatchSync` and hands it to the core in one call (`OffloadEngine.sync_batch`).
The adapter keeps its own view of each row (pool pages, mirror pages and history length as the core last
reported them), so building that description reads nothing of the core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload.sync import Admission, AppendRound, BatchSync, ChunkStore, RowSync
from flashmemory.offload.tiered_mirror import build_engine, dist_rank, engine_tier
from flashmemory.residency.level1 import AllPass, Level1, retriever_scorer
from flashmemory.residency.policy import ThresholdPagePolicy
from flashmemory.sglang.decode.adapter_level1 import Level1Calls
from flashmemory.sglang.decode.core_config import core_config, serving_tp_size
from flashmemory.sglang.decode.geometry import RATIO, PoolGeometryError, c4_counts, pool_buffers, read_geometry
from flashmemory.sglang.decode.loc_map import LocMap, pool_chunks
from flashmemory.sglang.decode.page_reads import PageReads
from flashmemory.sglang.metrics.miss_monitor import build_monitor
from flashmemory.sglang.metrics.prometheus import adapter_stats


class OffloadAdapter(Level1Calls):
    """Every method the hooks and the runtime call. Subclasses supply the mode: `_admission`, `_append_round`,
    `_appended`, and override the no-op defaults their mode needs."""

    mode = "base"
    device_bytes_saved = 0  # stock c4 KV bytes minus what the mode keeps on the device (default: nothing saved)
    # An extend forward's c4 attention reads the reserve (shrink mode): the runtime counts such forwards.
    extend_reads_reserve = False
    # sglang's pool holds every page of every request (copy mode), so a request whose first Level-1 plan has
    # not published may attend its whole history there, as stock does (`Runtime.pool_rows`).
    pool_before_plan = False

    def __init__(self, pool: Any, env: FlashMemoryEnv, retriever: Any = None, device: torch.device | str | None = None):
        self.pool, self.env = pool, env
        self.geo = geo = read_geometry(pool)
        self.kv_bufs, self.ix_bufs = pool_buffers(pool)
        bad = [l for l in env.retriever_layers if l >= geo.n_c4_layers]
        if bad:
            raise PoolGeometryError(
                f"SGLANG_RETRIEVER_INLINE_LAYERS {list(env.retriever_layers)}: the pool has "
                f"{geo.n_c4_layers} c4 layers; {bad} do not exist"
            )
        self.device = torch.device(device) if device is not None else self.kv_bufs[0].device
        # The env stops here: the core takes the typed configs made from it in one function.
        self.core = core_config(env, geo, landing_blocks=self.landing_blocks(), tp_size=serving_tp_size())
        self.layout, self.cfg, self.level1_cfg = self.core.layout, self.core.engine, self.core.level1
        # The disk tier (SGLANG_PATHP_DISK_DIR), else the plain engine; shrink keeps a full mirror (PD lands by page).
        self.engine = build_engine(
            self.layout,
            self.cfg,
            self.device,
            env.disk,
            self.target_buffers(),
            dist_rank(),
            full_mirror=self.mode == "shrink",
        )
        self.tier = engine_tier(self.engine)
        # How a request-local core error (a disk page failing verification) is raised: the guard's RequestFailure,
        # set by the hooks (this module cannot import the guard); None: it propagates as it is.
        self.make_failure: Callable[[str, str, str], BaseException] | None = None
        scorer = retriever_scorer(retriever, self.engine, self.core.ensemble) if retriever is not None else AllPass()
        self.indexers: dict[int, Any] = {}  # target c4 layer -> sglang's C4Indexer (filled by the runtime's hook)
        self.monitor = build_monitor(self.core.escalation, self.engine, lambda: self.indexers)
        self.l1 = Level1(
            self.engine, scorer, ThresholdPagePolicy(self.core.selection), self.level1_cfg, monitor=self.monitor
        )
        # What Level 2 reads, lent once by the core (the same storage for its lifetime): the lookup table (mirror
        # chunk -> reserve cell) and the reserve.
        self._cells, self._storage = self.engine.cell_table(), self.engine.storage()
        self._no_chunk = self.engine.no_chunk  # the mirror chunk id that reads -1 in the cell table (fixed)
        max_pages = self.layout.pages_for(self.cfg.max_chunks)
        self.locs = LocMap(geo.n_locs, geo.page_chunks, self._no_chunk, self.device, self.cfg.max_rows, max_pages)
        self.loc2m = self.locs.table  # pool loc -> mirror chunk (`loc_map`)
        self.rows: dict[str, int] = {}  # rid -> engine row
        self.page_reads = PageReads(geo.page_chunks)  # the pool page table on the host, read ahead of page opens
        self.pages: dict[int, list[int]] = {}  # engine row -> pool pages (logical page order)
        self.mpages: dict[int, tuple[int, ...]] = {}  # engine row -> mirror pages, as the core last reported them
        self.hist: dict[int, int] = {}  # engine row -> history chunks, as the core last reported them
        self.step_rows = torch.full((0,), -1, dtype=torch.int64)
        self._step_pages: torch.Tensor | None = None  # resident pages of step_rows, read by the step's sync
        self._step_unplanned: tuple[bool, ...] = ()  # per step row: no Level-1 plan published yet (same sync)

    def landing_blocks(self) -> int:
        """Reserve scratch blocks for extend stores (none unless the mode lands extends in the reserve)."""
        return 0

    def target_buffers(self) -> list[torch.Tensor] | None:
        """Device storage for the engine's target index pool (None: the engine allocates its own)."""
        return None

    # --- reads (graph safe: static tensors, no host sync) ----------------------------------------------
    @property
    def lut(self) -> torch.Tensor:
        """Int32 [n_locs + 1]: pool loc -> reserve cell, -1 = not resident (last entry -1)."""
        return self._cells[self.loc2m]

    @property
    def resident_mask(self) -> torch.Tensor:
        """Bool [n_locs]: pool loc is resident (mask mode)."""
        return self._cells[self.loc2m[:-1]] >= 0

    def cells_of(self, locs: torch.Tensor) -> torch.Tensor:
        """Top-k pool locs [B, K] (-1 empty) of the step's batch rows -> reserve cells [B, K] int32, -1 where not
        resident for that row's request (each row reads its own copy of a prefix page it shares). Graph safe."""
        return self._cells[self.locs.batch_chunks(locs)].to(torch.int32)

    def pool_picks(self, locs: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Top-k pool locs [B, K] (-1 empty) for attention reading sglang's pool: rows where full [B] is True keep
        every pick, the others only their resident ones (-1 elsewhere, as `cells_of`). Graph safe."""
        keep = full.reshape(-1, 1).to(torch.bool) | (self.cells_of(locs) >= 0)
        return torch.where(keep, locs, torch.full_like(locs, -1)).to(torch.int32)

    def unplanned_rows(self) -> list[bool]:
        """Per row of the step's batch: its request's first Level-1 plan has not published (the core's flags from
        this step's `sync_batch`, read with `step_resident_pages`; the forward gate holds publishes back)."""
        return list(self._step_unplanned)

    def size_batch(self, rows: int) -> None:
        """Make room for decode batches of `rows` rows (CUDA-graph padding included); before any capture."""
        self.locs.size_batch(rows)

    def reserve_kv(self, layer: int) -> torch.Tensor:
        """uint8 [n_blocks, kv_page_bytes]: the reserve of c4 layer `layer`, read by attention."""
        return self._storage.reserve_kv[layer]

    def reserve_index(self, layer: int) -> torch.Tensor | None:
        """None: the indexer addresses index-K by pool page table, not by reserve block, so handing it the
        Path-I reserve would score the wrong bytes; reads stay on sglang's pool buffer."""
        return None

    # --- the no-op defaults (each mode overrides what it does) ----------------------------------------
    def refresh_from_pool(self, layer: int, locs: torch.Tensor) -> None:
        """Before attention: this step's c4 entries at pool locs [T] into their reserve cells (default: nothing)."""

    def on_c4_store(self, layer: int, locs: torch.Tensor) -> None:
        """sglang stored c4 KV of `layer` at pool locs (HIP path; default: nothing)."""

    def store_cells(self, out_loc: torch.Tensor) -> torch.Tensor:
        """Where a store of pool locs out_loc [T] lands (default: the pool loc itself, as in stock sglang)."""
        return out_loc

    def mirror_buf_infos(self) -> dict[int, tuple[int, int, int]]:
        """Device buffer ptr -> (mirror ptr, bytes, page bytes) for PD receive (default: none, PD lands in the
        device pool as stock sglang does and `begin_step` reads each new request's history from it)."""
        return {}

    def host_ptrs(self) -> set[int]:
        """Mirror pointers NIXL must register as host DRAM (default: none)."""
        return set()

    def index_in_reserve(self, layer: int | None) -> bool:
        """c4 layer `layer`'s index-K lives in the Path-I reserve (default: never)."""
        return False

    def block_table(self, pages: torch.Tensor) -> torch.Tensor:
        """Pool pages [B, K] -> reserve blocks; only for layers with `index_in_reserve` (none by default)."""
        raise RuntimeError(f"{self.mode} mode keeps no index-K in the reserve (index_in_reserve is False)")

    def drop_sink(self, cells: torch.Tensor) -> torch.Tensor:
        """Top-k picks [B, K] with the sink block's removed (default: no reserve-block picks, unchanged)."""
        return cells

    def begin_forward(self, is_decode: bool) -> None:
        """Before any non-idle forward: where its c4 stores land (default: sglang's pool, nothing to do)."""

    def end_extend(self) -> None:
        """After an extend forward (default: its stores are in sglang's pool, read at admission)."""

    def settle(self) -> None:
        """After a decode forward: this step's new entries to the mirror (default: nothing)."""

    def queue_gate(
        self, waiting: Sequence[tuple[str, int, int]], n_next: int, table_of: Callable[[int, int, int], list[int]]
    ) -> set[str]:
        """Rids of sglang's decode waiting queue to hold back (the disk tier's cap: `ShrinkAdapter`); none here."""
        return set()

    def warm_cost(self, tokens: int) -> int:
        """Pages of `cfg.warm_step_pages` the warm start of a waiting request with `tokens` landed would take."""
        return self.engine.warm_pages_of(tokens // RATIO, self.level1_cfg.max_resident_pages)

    # --- the mode's part of begin_step ---------------------------------------------------------------
    def settle_before_step(self) -> ChunkStore | None:
        """First thing in `begin_step`: bytes of chunks appended earlier that the pool holds now, for the core to
        store first in the step's `sync_batch` (default: `settle`, nothing to store)."""
        self.settle()
        return None

    def _admission(self, row: int, rid: str, pages: list[int], n: int) -> Admission:
        raise NotImplementedError(f"{type(self).__name__} must describe its admissions")

    def _added_pages(self, row: int, rid: str, pages: list[int], own: Sequence[int]) -> tuple[int, ...]:
        """Mirror pages to claim for `row` this step, given its pool pages and its current mirror pages
        (default: none, the core allocates mirror pages itself as the history grows)."""
        return ()

    def _append_round(self, rows: list[int], locs: torch.Tensor) -> AppendRound:
        raise NotImplementedError(f"{type(self).__name__} must describe its appends")

    def _appended(self, locs: list[torch.Tensor], cells: Sequence[torch.Tensor]) -> None:
        """After the sync: per append round, the pool locs [n] appended and the reserve cells [n] they got."""

    # --- lifecycle ---------------------------------------------------------------------------------
    def _unmap(self, row: int) -> None:
        for per_row in (self.pages, self.mpages, self.hist):
            per_row.pop(row, None)
        self.locs.unmap(row)

    def _free_row(self) -> int:
        used = set(self.rows.values())
        for r in range(self.cfg.max_rows):
            if r not in used:
                return r
        raise RuntimeError(f"Path-P: more than SGLANG_PATHP_DECODE_MAX_CONC={self.cfg.max_rows} concurrent requests")

    def _mirror_pages_needed(self, n_chunks: int) -> int:
        """Host-mirror pages the core allocates to admit n_chunks (default: none, its own pool pages are)."""
        return 0

    def admission_refusals(self, rids: Sequence[str], seq_lens: torch.Tensor) -> list[tuple[str, str]]:
        """(rid, reason) for each request this step would admit but cannot (no free engine row, or the host mirror
        cannot hold its history), decided before anything changes, so the guard fails those requests alone and
        `begin_step` never sees them. seq_lens: [B] tokens with the current one, as `begin_step` gets them. Rows
        and mirror pages of requests leaving this step count as free (they are finished first); requests are
        taken in batch order."""
        before, _ = c4_counts(seq_lens.cpu())
        live = set(rids)
        leaving = [row for rid, row in self.rows.items() if rid not in live]
        free_rows = self.cfg.max_rows - (len(self.rows) - len(leaving))
        free_pages: int | None = None  # asked of the core only when a new request needs mirror pages
        out = []
        for rid, n in zip(rids, before.tolist()):
            if rid in self.rows or n < 1:
                continue
            need = self._mirror_pages_needed(n)
            if need and free_pages is None:
                free_pages = self.engine.free_mirror_pages() + sum(len(self.mpages.get(r, ())) for r in leaving)
            if free_rows < 1:
                out.append((rid, f"more than SGLANG_PATHP_DECODE_MAX_CONC={self.cfg.max_rows} concurrent requests"))
            elif need and need > (free_pages or 0):
                out.append((rid, f"host mirror full: its {n} c4 chunks need {need} pages, {free_pages} free"))
            else:
                free_rows -= 1
                if need:
                    free_pages = (free_pages or 0) - need
        return out

    def begin_step(self, rids: Sequence[str], page_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Sync requests before a decode forward. page_table: [B, P] c4 pool pages; seq_lens: [B] tokens with the
        current one. Returns engine rows [B] (-1: no c4 history yet). Vanished requests are finished, new ones
        admitted (`_admission`, newest KMAX pages made resident by the core's warm start), and each row's history
        is extended to the chunks this step closes (`_append_round`): all of it, with the bytes of last step's
        chunks the pool holds now (`settle_before_step`), in one `sync_batch` call."""
        stores = self.settle_before_step()
        before, after = c4_counts(seq_lens.cpu())
        live = set(rids)
        finished = []
        for rid in [r for r in self.rows if r not in live]:
            row = self.rows.pop(rid)
            finished.append(row)
            self._unmap(row)
        pc, rows, syncs = self.geo.page_chunks, [], []
        # Known pages (sglang never moves a running request's); a new row or a page opening reads the table
        known = [self.pages.get(self.rows[r], []) if r in self.rows else None for r in rids]
        pt = self.page_reads.pool_pages(rids, page_table, known, after.tolist(), seq_lens.tolist())
        for b, rid in enumerate(rids):
            pages = (pt[b] if pt is not None else known[b])[: -(-int(after[b]) // pc)]
            row, adm = self.rows.get(rid), None
            if row is None and int(before[b]) >= 1:
                row = self._free_row()
                adm = self._admission(row, rid, pages, int(before[b]))
                self.rows[rid], self.hist[row] = row, int(before[b])
            if row is not None:
                own = adm.mpages if adm is not None else self.mpages.get(row, ())
                syncs.append(RowSync(row, adm, self._added_pages(row, rid, pages, own or ())))
                self.pages[row] = pages
            rows.append(-1 if row is None else row)
        rounds, round_locs = [], []
        for k in range(max([int(after[b]) - self.hist[r] for b, r in enumerate(rows) if r >= 0], default=0)):
            lag = [(b, r, self.hist[r] + k) for b, r in enumerate(rows) if r >= 0 and self.hist[r] + k < int(after[b])]
            locs = torch.tensor([self.pages[r][n // pc] * pc + n % pc for _, r, n in lag], dtype=torch.int64)
            rounds.append(self._append_round([r for _, r, _ in lag], locs))
            round_locs.append(locs)
        self._step_pages, self._step_unplanned = None, ()  # unknown if the sync raises
        res = self.engine.sync_batch(BatchSync(tuple(finished), tuple(syncs), tuple(rounds), tuple(rows), stores))
        self._step_pages, self._step_unplanned = res.resident, res.unplanned
        self.mpages.update(res.mpages)
        self.hist.update(res.n_chunks)
        for rs in syncs:
            self.locs.map(rs.row, self.pages[rs.row], self.mpages.get(rs.row, ()))
        self._appended(round_locs, res.cells)
        self.step_rows = torch.tensor(rows, dtype=torch.int64)
        self.locs.set_batch(rows)  # engine row per batch row, for `cells_of` (rewritten only when it changed)
        return self.step_rows

    # --- copies from sglang's pool (copy mode's stores; either mode's HIP index stores) -----------------
    def _copy_from_pool(self, locs: torch.Tensor, layers: Sequence[int], kv: bool, index: bool) -> None:
        """Pool locs [n] of `layers` -> the core's `store_chunks` (mirror, and the reserve where resident)."""
        st = self._pool_chunks(locs, layers, kv, index)
        if st is not None:
            self.engine.store_chunks(st.m, st.layers, st.kv, st.index)

    def _pool_chunks(self, locs: torch.Tensor, layers: Sequence[int], kv: bool, index: bool) -> ChunkStore | None:
        """The bytes sglang's pool holds at locs [n] of `layers`, in the core's mirror chunks (`loc_map`)."""
        return pool_chunks(self.locs, self.layout, (self.kv_bufs, self.ix_bufs), locs, layers, kv, index)

    def on_index_store(self, layer: int, locs: torch.Tensor) -> None:
        """sglang stored index-K of `layer` at pool locs (HIP path): mirror / target pool / reserve."""
        self._copy_from_pool(locs.reshape(-1), [layer], kv=False, index=True)

    # --- Level 2 / stats (Level 1: `adapter_level1.Level1Calls`) ---------------------------------------
    def resident_pages(self, rows: torch.Tensor) -> torch.Tensor:
        """Int64 [B, kmax + decode_pages] resident logical pages per row, ascending, -1 padded (-1 rows: all -1)."""
        return self.engine.resident_pages(rows)

    def step_resident_pages(self) -> torch.Tensor:
        """`resident_pages(step_rows)` as the step's sync read them: current until `close_forward`, since the core's
        forward gate (taken by `open_forward`) holds Level-1 publishes back until then."""
        if self._step_pages is None:
            return self.resident_pages(self.step_rows)
        return self._step_pages

    def live_history(self) -> int:
        """c4 chunks of the live requests' histories (O(1), the core's running total); 0 when none is live."""
        return int(self.engine.totals()["history_chunks"])

    def stats(self) -> dict[str, float]:
        """The keys of `flashmemory.sglang.metrics.prometheus.METRICS` (`prometheus.adapter_stats`: O(1), no scan of
        requests, no device read; the exporter thread calls it)."""
        return adapter_stats(self)

    def open_forward(self, is_decode: bool) -> None:
        """Before any non-idle forward: the core learns the forward's stream and holds Level-1 table writes until
        `close_forward`; then the mode's `begin_forward`."""
        self.engine.begin_forward()
        self.begin_forward(is_decode)

    def close_forward(self) -> None:
        """The forward is enqueued (or raised): Level-1 table writes may land. Idempotent."""
        self.engine.end_forward()

    def close(self) -> None:
        self.engine.end_forward()  # the worker may wait for the forward gate this thread holds
        self.l1.close()
        if self.tier is not None:
            self.tier.close()
