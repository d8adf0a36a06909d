"""Path-P on a PD decode server ("B mode"): the device c4 KV pool shrinks to the reserve.

A subclass of `offload_adapter.OffloadAdapter`, as copy mode (`copy_adapter.CopyAdapter`) is. Copy mode
leaves sglang's c4 pool complete and keeps the mirror and reserve as copies of it, so it saves no device memory.
Here:

  mirror   addressed by pool page (mirror page == c4 pool page, pool loc == mirror chunk), so a PD transfer
           lands in it directly: `mirror_buf_infos` swaps each c4 KV buffer for its mirror in
           `get_contiguous_buf_infos`, and `nixl_mem_kinds` marks those entries DRAM for NIXL (sglang 0.5.23
           mixes VRAM/DRAM destinations for HiSparse the same way, `disaggregation/decode.py:629-644`).
  device   `pool.c4_kv_pool.kv_buffer[l]` becomes the reserve of layer l (recall blocks | decode regions | sink |
           landing); the full-size buffers are dropped.
  stores   sglang's compressor writes a new c4 entry at pool loc `core_metadata.c4_out_loc`; the shrink rows'
           `shrink_hooks.around_compress` swaps those locs for `store_cells(out_loc)` during the c4 KV compressor's call
           (where HiSparse translates them, `layers/attention/dsv4/compressor_v2.py:227`): in decode the entry's
           reserve cell (assigned and published by `begin_step` before the forward; graph safe: two gathers on
           static tensors), in extend a landing cell (moved to the mirror afterwards).
  settle   after each forward the new entries go reserve -> mirror, and Path-I index-K pool -> mirror: copied
           into pinned host memory on the forward stream (no host wait), written into the mirror by a later
           `begin_step` once the copy is complete.

The target layers' index-K stays in sglang's device pool and doubles as the engine's target index pool. With
Path-I and score-resident Level 2 (`index_in_reserve`), the non-target layers' index-K pool is replaced by the
Path-I reserve too: the indexer compressor stores through `store_cells` (`shrink_hooks.around_compress`), PD lands
those pages in the mirror, and the indexer scores a view whose page table holds reserve blocks
(`block_table`), so its top-k are reserve cells already.
Only safe where every forward is decode or extend: `shrink_blockers` lists what rules the mode out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload.sync import Admission, AppendRound, StagedSettle
from flashmemory.sglang.decode.offload_adapter import OffloadAdapter

logger = logging.getLogger(__name__)
DEFAULT_EXTEND_TOKENS = 16384  # sglang's default max_prefill_tokens
STAGED_STEPS = 3  # steps a staged settle may stay pending before `begin_step` waits for it


class LandingOverflowError(RuntimeError):
    """An extend forward closed more c4 entries than the landing region holds (sized from the server args)."""


def shrink_blockers(server_args: Any) -> list[str]:
    """Why the shrink cannot run with these sglang server args ([] = it can)."""
    if server_args is None:
        return ["sglang server args are unknown"]
    out = []
    mode = str(getattr(server_args, "disaggregation_mode", None) or "null").lower()
    if mode != "decode":
        out.append(f"--disaggregation-mode is {mode!r}, not 'decode' (prefill runs on this server)")
    backend = str(getattr(server_args, "disaggregation_transfer_backend", None) or "").lower()
    # 'fake' (sglang's synthetic-benchmark backend) transfers nothing, so there is nothing to land anywhere.
    if mode == "decode" and backend not in ("nixl", "fake"):
        out.append(f"--disaggregation-transfer-backend {backend!r}: landing PD transfers in host DRAM needs 'nixl'")
    if getattr(server_args, "speculative_algorithm", None):
        out.append("speculative decoding (its verify/draft forwards read the c4 pool outside Path-P)")
    if getattr(server_args, "enable_mixed_chunk", False):
        out.append("--enable-mixed-chunk (mixed extend+decode forwards)")
    if getattr(server_args, "enable_hisparse", False):
        out.append("--enable-hisparse (it owns the same translation seam)")
    if getattr(server_args, "enable_hierarchical_cache", False):
        out.append("--enable-hierarchical-cache (it copies c4 KV by pool loc)")
    if getattr(server_args, "disaggregation_decode_enable_offload_kvcache", False):
        out.append("--disaggregation-decode-enable-offload-kvcache (it copies c4 KV by pool loc)")
    if getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        out.append("--disaggregation-decode-enable-radix-cache (live requests would share mirror pages)")
    if int(getattr(server_args, "pp_size", 1) or 1) > 1:
        out.append("pipeline parallelism (--pp-size > 1)")
    return out


def landing_chunks(server_args: Any) -> int:
    """Landing cells for one extend forward: every c4 entry it can close (tokens / 4, plus one per request)."""
    if server_args is None:
        return DEFAULT_EXTEND_TOKENS // 4 + 128
    tokens = (
        max(
            int(getattr(server_args, "chunked_prefill_size", None) or 0),
            int(getattr(server_args, "max_prefill_tokens", None) or 0),
        )
        or DEFAULT_EXTEND_TOKENS
    )
    reqs = int(getattr(server_args, "max_running_requests", None) or 0) or 1024
    return -(-tokens // 4) + reqs


class ShrinkAdapter(OffloadAdapter):
    """Shrink mode: a pool-addressed mirror and the device c4 KV pool replaced by the reserve."""

    mode = "shrink"
    extend_reads_reserve = True
    # A PD transfer lands in the host mirror and the device keeps only the reserve (KMAX pages and the decode
    # region per row), so before its first Level-1 plan a request attends its warm start (the newest KMAX pages)
    # alone: full attention then would need the whole history on the device.
    pool_before_plan = False

    def __init__(
        self,
        pool: Any,
        env: FlashMemoryEnv,
        retriever: Any = None,
        device: torch.device | str | None = None,
        n_landing: int = DEFAULT_EXTEND_TOKENS // 4 + 128,
    ):
        self.n_landing = n_landing
        super().__init__(pool, env, retriever, device)
        self.slots = self.engine.slots()  # the reserve's fixed block layout (sink, landing)
        # Path-I in the reserve needs score-resident Level 2: mask mode scores every page of the history.
        self.index_shrink = bool(self.layout.offload_index_layers) and env.score_resident
        if self.layout.offload_index_layers and not env.score_resident:
            logger.warning(
                "FlashMemory shrink: Path-I keeps the non-target index-K on the device (it needs "
                "SGLANG_PATHP_SCORE_RESIDENT=1 to be read from the reserve)"
            )
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pool locs, cells the kernel writes) [n]
        self._landing: tuple[torch.Tensor, torch.Tensor] | None = None  # (pool locs, landing cells) of this extend
        self._staged: list[tuple[int, StagedSettle]] = []  # (steps waited, settle on its way to the mirror)
        self.phase = "decode"
        self.device_bytes_saved = 0
        self._shrink()

    def landing_blocks(self) -> int:
        return math.ceil(self.n_landing / self.geo.page_chunks)

    def target_buffers(self) -> list[torch.Tensor]:
        return [self.ix_bufs[l][: self.geo.n_pages] for l in self.layout.target_layers]

    def _shrink(self) -> None:
        kv_pool, res, sl = self.pool.c4_kv_pool, self.engine.storage(), self.slots
        full = self.geo.n_c4_layers * self.geo.n_pages * self.geo.kv_page_bytes  # what stock sglang allocates
        for l in range(self.geo.n_c4_layers):
            kv_pool.kv_buffer[l] = res.reserve_kv[l]
        self.kv_bufs = list(kv_pool.kv_buffer)
        self.device_bytes_saved = full - res.reserve_kv.numel()
        if self.index_shrink:
            ix = self.pool.c4_indexer_kv_pool.index_k_with_scale_buffer
            for i, l in enumerate(self.layout.offload_index_layers):
                self.device_bytes_saved += ix[l].numel() - res.reserve_index[i].numel()
                ix[l] = res.reserve_index[i]
            self.ix_bufs = list(ix)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.env.pd_credit_c4:
            logger.warning(
                "FlashMemory shrink with SGLANG_PD_CREDIT_OFFLOADED_C4: sglang's token pool was sized "
                "without c4 KV bytes, so the reserve (%.2f GiB) comes out of the non-static headroom; "
                "lower --mem-fraction-static by that much if activations or CUDA graphs run short",
                res.reserve_kv.numel() / 2**30,
            )
        if self.device_bytes_saved <= 0:
            logger.warning(
                "FlashMemory shrink: the reserve (%d blocks/layer) is not smaller than the c4 pool "
                "(%d pages): it saves no device memory; lower SGLANG_PATHP_RESERVE_PAGES / DECODE_MAX_CONC",
                sl.n_blocks,
                self.geo.n_pages,
            )
        logger.info(
            "FlashMemory Path-P shrink: device c4 KV %.2f GiB -> reserve %.2f GiB (%d blocks/layer incl. "
            "%d landing); PD lands c4 KV in the host mirror (%.2f GiB)",
            full / 2**30,
            res.reserve_kv.numel() / 2**30,
            sl.n_blocks,
            sl.landing_blocks,
            res.mirror_kv.numel() / 2**30,
        )

    # --- the store seam ---------------------------------------------------------------------------
    def store_cells(self, out_loc: torch.Tensor) -> torch.Tensor:
        """Where sglang's compressor writes the c4 entries of pool locs out_loc [T] (0 = no entry this token).

        Decode: the reserve cell `begin_step` published (graph safe). Extend: consecutive landing cells, moved to
        the mirror by `end_extend`. Anything unknown goes to the sink cell, never to another request's cell."""
        loc = out_loc.long()
        sink = self.slots.sink_cell
        if self.phase == "extend":
            return self._landing_cells(loc).to(out_loc.dtype)
        n = self.geo.n_locs
        idx = torch.where((loc >= 0) & (loc < n), loc, torch.full_like(loc, n))
        cells = self.engine.cell_table()[self.loc2m[idx]].long()
        return torch.where(cells >= 0, cells, torch.full_like(cells, sink)).to(out_loc.dtype)

    def _landing_cells(self, loc: torch.Tensor) -> torch.Tensor:
        res, pc = self.slots, self.geo.page_chunks
        ok = (loc > 0) & (loc < self.geo.n_locs)
        k = int(ok.sum())
        if k > res.landing_blocks * pc:
            raise LandingOverflowError(
                f"FlashMemory shrink: an extend forward stores {k} c4 entries, the landing "
                f"region holds {res.landing_blocks * pc} (sized from --max-prefill-tokens / "
                "--chunked-prefill-size; raise those consistently or turn "
                "SGLANG_PD_B_C4_SHRINK off)"
            )
        cells = torch.where(ok, res.landing_base * pc + ok.long().cumsum(0) - 1, torch.full_like(loc, res.sink_cell))
        if self._landing is None:  # every c4 layer of one forward passes the same out_loc
            self._landing = (loc[ok].clone(), cells[ok].clone())
        return cells

    def index_in_reserve(self, layer: int | None) -> bool:
        """c4 layer `layer`'s index-K lives in the Path-I reserve (stores translated, reads by block table)."""
        return self.index_shrink and layer in self.layout.offload_index_layers

    def block_table(self, pages: torch.Tensor) -> torch.Tensor:
        """Pool pages [B, K] (a score-resident view's table) -> reserve blocks [B, K] int32; pages without a
        block map to the sink block, whose picks `drop_sink` removes. Graph safe: one gather."""
        pc, n = self.geo.page_chunks, self.geo.n_pages
        p = pages.long()
        loc = torch.where((p >= 0) & (p < n), p * pc, torch.full_like(p, self.geo.n_locs))
        cell = self.engine.cell_table()[self.loc2m[loc]].long()
        return torch.where(cell >= 0, cell // pc, torch.full_like(cell, self.slots.sink_block)).to(torch.int32)

    def drop_sink(self, cells: torch.Tensor) -> torch.Tensor:
        """Top-k picks that are reserve cells [B, K]: those in the sink block become -1."""
        sink = self.slots.sink_block
        return torch.where(
            torch.div(cells, self.geo.page_chunks, rounding_mode="floor") == sink, torch.full_like(cells, -1), cells
        )

    def begin_forward(self, is_decode: bool) -> None:
        self.phase = "decode" if is_decode else "extend"
        self._landing = None

    def end_extend(self) -> None:
        """After an extend forward: landing cells -> mirror (and any resident cell) for every c4 layer."""
        got, self._landing, self.phase = self._landing, None, "decode"
        if got is not None and got[0].numel():
            self._move(got[0], got[1])

    # --- request lifecycle ---------------------------------------------------------------------------
    def begin_step(self, rids: Sequence[str], page_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """As `OffloadAdapter.begin_step`; the steps below differ: admission claims the request's own pool pages as
        its mirror pages (PD, or an extend's landing, already put the bytes there), and new chunks get cells only
        (sglang's store kernel writes them, `settle` moves them to the mirror)."""
        self.begin_forward(True)
        self._apply_staged(rids)
        return super().begin_step(rids, page_table, seq_lens)

    def _admission(self, row: int, rid: str, pages: list[int], n: int) -> Admission:
        hist = pages[: -(-n // self.geo.page_chunks)]
        if not self.index_shrink:  # else PD landed the Path-I index-K in the mirror too
            # Before the core call: the admission's tail page and warm start copy these mirror pages to the
            # reserve. The pages are this request's pool pages, so no live request's mirror bytes change.
            self._index_to_mirror(torch.tensor(hist, dtype=torch.int64))
        return Admission(row, rid, n, mpages=tuple(hist), warm_pages=self.level1_cfg.max_resident_pages)

    def _added_pages(self, row: int, rid: str, pages: list[int], own: Sequence[int]) -> tuple[int, ...]:
        own = list(own)
        if pages[: len(own)] != own:
            raise RuntimeError(
                f"FlashMemory shrink: request {rid}'s c4 pages changed under it ({own[:4]}... -> {pages[:4]}...)"
            )
        return tuple(pages[len(own) :])

    def _append_round(self, rows: list[int], locs: torch.Tensor) -> AppendRound:
        return AppendRound(tuple(rows))  # cells only: sglang's store kernel writes the bytes

    def _appended(self, locs: list[torch.Tensor], cells: Sequence[torch.Tensor]) -> None:
        self._pending.extend(zip(locs, cells))

    def settle(self) -> None:
        """After a decode forward: the entries sglang stored in reserve cells during it start toward the mirror
        (`stage_settle`: device gather, copy into pinned host memory, an event; no host wait). `begin_step` writes
        them into the mirror once the copy is complete (`_apply_staged`)."""
        if self._pending:
            locs = torch.cat([p[0] for p in self._pending]).long()
            cells = torch.cat([p[1] for p in self._pending])
            self._pending = []
            self._staged.append((0, self.engine.stage_settle(locs, cells, self._index_rows(locs))))

    def settle_before_step(self) -> None:
        self.settle()
        return None

    def _apply_staged(self, rids: Sequence[str], wait: bool = False) -> None:
        """Write the staged settles whose copy is complete into the mirror, chunks of requests still in the batch
        only (a finished request's pages may be freed and refilled by a PD transfer by now). A settle left pending
        for STAGED_STEPS steps is waited for (under the overlap scheduler it is done after two: sglang has read
        that forward's result), so a page is in the mirror before the disk tier could seal it (4 steps later)."""
        if not self._staged:
            return
        pc, live = self.geo.page_chunks, set(rids)
        pages = {p for rid, row in self.rows.items() if rid in live for p in self.pages.get(row, ())}
        left = []
        for age, st in self._staged:
            keep = torch.tensor([loc // pc in pages for loc in st.m.tolist()], dtype=torch.bool)
            if not self.engine.apply_settle(st, keep, wait=wait or age + 1 >= STAGED_STEPS):
                left.append((age + 1, st))
        self._staged = left

    def _index_rows(self, locs: torch.Tensor) -> torch.Tensor | None:
        """Path-I index-K of pool locs [n] from sglang's device pool (device uint8 [n_path_i_layers, n, bytes]);
        None where the reserve holds it (`index_shrink`) or there is no Path-I."""
        pc, ol = self.geo.page_chunks, self.layout.offload_index_layers
        if not ol or self.index_shrink:
            return None
        return torch.stack([self.layout.index.read_chunks(self.ix_bufs[l], locs // pc, locs % pc) for l in ol])

    def close(self) -> None:
        for _, st in self._staged:
            self.engine.apply_settle(st, wait=True)
        self._staged = []
        super().close()

    def _move(self, locs: torch.Tensor, cells: torch.Tensor) -> None:
        """c4 KV at reserve cells [n] (all layers) -> mirror chunks == pool locs [n], and -> the cell each loc is
        resident in now if that differs (a recall published meanwhile); Path-I index-K (the same cells of the
        Path-I reserve with `index_shrink`, else sglang's device index-K pool) -> mirror and resident cell."""
        pc, ol = self.geo.page_chunks, self.layout.offload_index_layers
        index = None
        if ol and not self.index_shrink:
            index = torch.stack(
                [
                    self.layout.index.read_chunks(
                        self.ix_bufs[l], (locs // pc).to(self.ix_bufs[l].device), (locs % pc).to(self.ix_bufs[l].device)
                    ).cpu()
                    for l in ol
                ]
            )
        self.engine.settle_cells(locs.long(), cells, index)

    def _index_to_mirror(self, pages: torch.Tensor) -> None:
        """Path-I: whole index-K pages of the non-target layers, sglang's device pool -> the mirror."""
        rows = [self.ix_bufs[l][pages.to(self.ix_bufs[l].device)].cpu() for l in self.layout.offload_index_layers]
        if rows:
            self.engine.store_index_pages(pages, torch.stack(rows))

    # --- requests waiting to run (the disk tier's DRAM cap) ----------------------------------------------
    def queue_gate(
        self, waiting: Sequence[tuple[str, int, int]], n_next: int, table_of: Callable[[int, int, int], list[int]]
    ) -> set[str]:
        """sglang's decode waiting queue, in order: (rid, req_pool_idx, tokens whose KV landed); its first `n_next`
        are admitted next. Hands it to the tier's `QueuedPages` (new requests with their c4 pool pages:
        `table_of(req_pool_idx, tokens, page_size)`, one page-table read each) and returns the rids to hold back
        from admission while their pages come back from disk. Nothing without the tier's cap
        (SGLANG_PATHP_HOST_MIRROR_GB)."""
        q = self.engine.queued_pages()
        if q is None:
            return set()
        order: list[tuple[str, list[int] | None]] = []
        pc = self.geo.page_chunks
        for rid, idx, tokens in waiting:
            pages = None
            if not q.known(rid) and tokens >= 4:
                n = -(-(tokens // 4) // pc)  # pages holding its c4 entries
                pages = [p for p in table_of(idx, tokens, self.pool.page_size)[:n] if p >= 0]
            order.append((rid, pages))
        return q.update(order, n_next)

    def admission_refusals(self, rids: Sequence[str], seq_lens: torch.Tensor) -> list[tuple[str, str]]:
        """As `OffloadAdapter.admission_refusals`, and a new request whose queued pages did not come back from the
        tier (a read error or checksum mismatch, named) or are not in DRAM yet is refused: it fails alone."""
        out = super().admission_refusals(rids, seq_lens)
        q = self.engine.queued_pages()
        if q is None:
            return out
        refused = {r for r, _ in out}
        for rid in rids:
            why = None if rid in self.rows or rid in refused else q.refusal(str(rid))
            if why:
                out.append((rid, why))
        return out

    # --- stores and reads ------------------------------------------------------------------------------
    def mirror_buf_infos(self) -> dict[int, tuple[int, int, int]]:
        """Device buffer ptr (the reserve, now sglang's c4 KV and, with `index_shrink`, Path-I index-K buffers)
        -> (mirror ptr, mirror bytes, page bytes)."""
        st = self.engine.storage()
        m, res = st.mirror_kv, st.reserve_kv
        out = {res[l].data_ptr(): (m[l].data_ptr(), m[l].numel(), m.shape[-1]) for l in range(self.geo.n_c4_layers)}
        if self.index_shrink:
            mi, ri = st.mirror_index, st.reserve_index
            out.update({ri[i].data_ptr(): (mi[i].data_ptr(), mi[i].numel(), mi.shape[-1]) for i in range(ri.shape[0])})
        return out

    def host_ptrs(self) -> set[int]:
        return {v[0] for v in self.mirror_buf_infos().values()}
