"""Process-wide FlashMemory state inside one sglang scheduler process, and the offload-core contract.

The hooks (`hooks.py`) are thin: they pull tensors off sglang objects and call into `RUNTIME`, the one
per-process object (configs, the adapter and its core, the retriever, metrics, the guard, the static buffers);
what one forward uses lives in `RUNTIME.fwd` (`context.ForwardContext`, built per forward). The Path-P
adapter (`offload_adapter.OffloadAdapter`: copy mode `copy_adapter.CopyAdapter` or shrink mode
`shrink_adapter.ShrinkAdapter`) puts the offload core behind sglang's pool; the base class carries every method the
hooks call (no-op defaults), so neither this module nor the hooks probe what the adapter can do. Static buffers
live here so the decode CUDA graph can bake them in.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from flashmemory.env import FlashMemoryEnv, stats_file
from flashmemory.offload import streams
from flashmemory.offload.step import StepBudget
from flashmemory.sglang.decode.context import ForwardContext, HiSparseState
from flashmemory.sglang.decode.guard import Guard
from flashmemory.sglang.decode.server import server_args
from flashmemory.sglang.decode.sideband import SidebandBuffers, SidebandError
from flashmemory.sglang.decode.tables import Level2Buffers, Level2CapacityError, c4_page_table, host_seq_lens
from flashmemory.sglang.metrics.exporter import MetricsExporter, write_diagnostics

if TYPE_CHECKING:
    from flashmemory.sglang.decode.offload_adapter import OffloadAdapter

logger = logging.getLogger(__name__)


def build_engine(pool: Any, env: FlashMemoryEnv, shrink: bool = False, retriever: Any = None) -> "OffloadAdapter":
    """Create the offload engine for an sglang DSv4 pool (`flashmemory.sglang.decode.adapter_factory.build`), with the
    retriever the plugin checked at registration."""
    from flashmemory.sglang.decode import adapter_factory

    return adapter_factory.build(pool, env, server_args(), shrink=shrink, retriever=retriever)


class Runtime:
    """State for one scheduler process (lives as long as it); `configure` is called by `plugin.register`. The
    current forward's scratch is `fwd`, replaced by `before_forward`."""

    def __init__(self) -> None:
        self.env = FlashMemoryEnv()
        self.features: tuple[str, ...] = ()
        self.pool: Any = None
        self.engine: OffloadAdapter | None = None  # copy or shrink mode: one base, no capability probes
        self.retriever: Any = None  # JointRetriever checked at registration (Level 1 on)
        self.bufs: Level2Buffers | None = None
        self.dump = None
        self.metrics = None
        self.exporter: MetricsExporter | None = None  # runs `export` on its own thread (built with the adapter)
        self.sideband: SidebandBuffers | None = None  # Level-1 inputs, written in place by the indexer hook
        self.sideband_rows_hint = 0  # largest decode batch the server may run (init_cuda_graphs)
        self.indexers: dict[int, Any] = {}  # target c4 layer -> sglang's C4Indexer (miss monitor)
        self._sideband_frozen = False  # a graph has recorded the buffers: never reallocate
        self._sideband_checked: set[int] = set()  # batch sizes whose side band was verified fresh
        # (batch size, side band, host copy of `written`, its event): freshness verdicts on their way to the host
        self._sideband_pending: list[tuple[int, SidebandBuffers, torch.Tensor, Any]] = []
        self._sideband_stale: set[int] = set()  # batch sizes whose last verdict was stale: Level 1 skips them
        self.fwd = ForwardContext()  # the current forward's scratch (built per forward)
        self.in_compressed_pools = False  # inside DeepSeekV4TokenToKVPool._init_compressed_pools
        self._shrink: bool | None = None  # shrink decision, made once per process
        self.steps = 0
        self.step_budget = StepBudget()  # warm-start pages the PD waiting queue let out this step (queue_gate)
        self.counters: dict[str, int] = {}
        self.diag_path = stats_file()  # diagnostics for scripts/gpu_check.py
        # (target, kind, impl) -> target of every Patch row applied in this process (`patching.apply`: once each)
        self.applied_patches: dict[tuple[str, str, str], str] = {}
        self.registration: dict | None = None  # what `plugin.register` did here (None before it ran)
        self.guard = Guard()  # the per-request failure guard every hook runs under (`guard.guarded`)
        self.hisparse = HiSparseState()  # the HiSparse CPU swap-in and prefetch modes' state

    def count(self, name: str) -> None:
        """Host-side event counter (Python only; under CUDA-graph replay the hooks do not run at all)."""
        self.counters[name] = self.counters.get(name, 0) + 1

    def export(self, full: bool = False) -> None:
        """One metrics export (the exporter's thread, or idle time): the serving gauges, every metric when `full` or
        when a request joined or left, and the diagnostics file. Reads the core's running totals under its lock
        (O(1), no device read); never called on the decode thread."""
        if self.metrics is not None and self.engine is not None:
            self.metrics.refresh(self.engine, full)
        try:
            self.write_diagnostics()
        except OSError as e:
            logger.warning("FlashMemory: diagnostics not written (%s)", e)
            self.diag_path = ""

    def write_diagnostics(self) -> None:
        """The diagnostics file, $FLASHMEMORY_STATS_FILE (`exporter.write_diagnostics`), if set."""
        write_diagnostics(self)

    def configure(self, env: FlashMemoryEnv, features: tuple[str, ...], retriever: Any = None) -> None:
        self.env, self.features, self.retriever = env, features, retriever
        if "dump" in features:
            from flashmemory.sglang.dump.mode import DumpRecorder

            self.dump = DumpRecorder(root=env.dump_root or None)

    def on(self, feature: str) -> bool:
        return feature in self.features

    def serving_rows(self, max_running_requests: int = 0, graph_max_bs: int = 0) -> int:
        """Rows the Level-2 buffers need for this server: its largest decode batch (--max-running-requests, the
        CUDA-graph batch sizes) and the core's request rows (SGLANG_PATHP_DECODE_MAX_CONC)."""
        sa = server_args()
        return max(
            self.env.decode_max_conc,
            int(max_running_requests or 0),
            int(graph_max_bs or 0),
            int(getattr(sa, "max_running_requests", None) or 0),
            int(getattr(sa, "cuda_graph_max_bs_decode", None) or 0),
        )

    def level2_buffers(self, rows: int, device: torch.device | str) -> Level2Buffers:
        """The static Level-2 buffers: allocated by the first call, on `device`, for `serving_rows(rows)` rows;
        never reallocated, since a CUDA graph that recorded them would keep reading the old storage. A batch
        larger than they hold raises Level2CapacityError (the start-up refusals keep batches within them)."""
        if self.bufs is None:
            self.bufs = Level2Buffers.allocate(self.serving_rows(rows), self.level2_width(), device)
            if self.engine is not None:
                self.engine.size_batch(self.bufs.rows)  # its per-batch-row map too, before any capture
            logger.info(
                "FlashMemory: Level-2 buffers [%d, %d] allocated on %s", self.bufs.rows, self.level2_width(), device
            )
        elif rows > self.bufs.rows:
            raise Level2CapacityError(
                f"FlashMemory: a decode batch of {rows} rows exceeds the Level-2 buffers' "
                f"{self.bufs.rows} rows (sized from --max-running-requests and "
                "SGLANG_PATHP_DECODE_MAX_CONC before capture)"
            )
        return self.bufs

    def check_refusals(self, max_running_requests: int = 0) -> None:
        """Stop start-up (StartupError, one line naming the flag) on a configuration the active features cannot
        serve (`refusals.refusals`); max_running_requests: the model runner's resolved value, when known."""
        from flashmemory.sglang.decode.refusals import refusals, refuse, rows_refusal

        lines = refusals(server_args(), self.env, self.features)
        if self.on("path_p") and max_running_requests:
            line = rows_refusal(int(max_running_requests), self.env)
            if line and line not in lines:
                lines.append(line)
        refuse(lines)

    def level2_width(self) -> int:
        """Pages per row in the Level-2 buffers: KMAX recalled pages (the escalation cap with the miss monitor) plus
        the decode region."""
        return self.env.miss_kmax_cap_pages() + -(-self.env.decode_resident_chunks // 64)

    # --- memory pool ------------------------------------------------------------------------------
    def shrink_planned(self) -> bool:
        """Path-P runs in shrink mode in this process (decided once, from the gates and the server args)."""
        if self._shrink is None:
            if not (self.on("path_p") and self.env.pd_c4_shrink):
                self._shrink = False
            else:
                from flashmemory.sglang.decode.shrink_adapter import shrink_blockers

                blockers = shrink_blockers(server_args())
                self._shrink = not blockers
                if blockers:
                    logger.warning(
                        "FlashMemory Path-P in copy mode (the device c4 pool stays full size, no device "
                        "memory saved): SGLANG_PD_B_C4_SHRINK needs %s",
                        "; ".join(f"not {b}" for b in blockers),
                    )
        return self._shrink

    def attach_pool(self, pool: Any) -> None:
        if getattr(pool, "is_draft_worker", False) or self.pool is not None:
            return
        self.pool = pool
        if self.on("path_p"):
            self.check_refusals()
            self.engine = build_engine(pool, self.env, self.shrink_planned(), self.retriever)
            self.engine.indexers = self.indexers  # shared: the hook fills it, the miss monitor reads it
            self.level2_buffers(0, self.engine.device)  # once, sized for the server, before any capture
            try:
                from flashmemory.sglang.metrics.prometheus import FlashMemoryMetrics

                self.metrics = FlashMemoryMetrics.create()
            except (ImportError, ValueError) as e:  # no prometheus_client, or already registered in this process
                logger.warning("FlashMemory: metrics not exported (%s)", e)
            self.exporter = MetricsExporter(self.export).start()
            logger.info("FlashMemory: offload engine attached to %s", type(pool).__name__)

    def c4_layer(self, pool: Any, layer_id: int) -> int | None:
        """c4 ordinal of a model layer, None for non-c4 layers."""
        ratio, compress_layer_id, _ = pool.layer_mapping[layer_id][:3]
        return compress_layer_id if ratio == 4 else None

    # --- side band (Level 1) -----------------------------------------------------------------------
    def capture_sideband_input(
        self,
        layer: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        capturing: bool,
        q_lora: torch.Tensor | None = None,
        indexer: Any = None,
        q_lora_ready: Any = None,
    ) -> None:
        """Target c4 layer `layer`'s indexer hook: copy x [B, hidden] and positions [B] into the static side band.

        The buffers are allocated on the first (eager) call, which precedes capture (sglang warms every bucket up
        eagerly, largest first), sized max(B, SGLANG_PATHP_DECODE_MAX_CONC, server max batch). Under capture, or
        once a graph has recorded them, a misfit raises instead of reallocating (the graph would keep writing the
        old buffers). The copy itself is graph safe (`SidebandBuffers.write`). With the miss monitor the indexer's
        q_lora rides along (its copy waits on sglang's `q_lora_ready` event where one is recorded: multi-stream
        decode), and the indexer module is remembered (the monitor recomputes its native query)."""
        monitor = self.env.miss_monitor and q_lora is not None
        if monitor and indexer is not None:
            self.indexers[layer] = indexer
        sb = self.sideband
        if sb is None or not sb.accepts(layer, x) or not sb.accepts_q_lora(layer, q_lora if monitor else None):
            if capturing or self._sideband_frozen:
                raise SidebandError(
                    f"FlashMemory side band: no static buffer for c4 layer {layer} input "
                    f"{x.dtype} {tuple(x.shape)} {x.device} and it cannot be (re)allocated "
                    "under / after CUDA-graph capture"
                )
            rows = max(x.shape[0], self.env.decode_max_conc, self.sideband_rows_hint)
            sb = self.sideband = SidebandBuffers.allocate(
                tuple(self.env.retriever_layers),
                rows,
                x.shape[1],
                x.dtype,
                x.device,
                q_lora_rank=q_lora.shape[1] if monitor else 0,
                q_lora_dtype=q_lora.dtype if monitor else None,
            )
            self._sideband_pending, self._sideband_stale = [], set()  # verdicts were about the old buffers
            logger.info(
                "FlashMemory: Level-1 side band [%d, %d] x %d layers allocated", rows, x.shape[1], len(sb.layers)
            )
        if capturing:
            self._sideband_frozen = True
        sb.write(layer, x.detach(), positions, q_lora.detach() if monitor else None, q_lora_ready if monitor else None)

    def sideband_snapshot(self, n_rows: int) -> dict[str, torch.Tensor] | None:
        """Views of the side band's first n_rows (the real requests) after a decode forward; {} without a side
        band (no retriever); None while this batch size is known stale (a target layer did not write: its hook is
        not in the graph, the rows would be stale; Level 1 skips those steps).

        Freshness is checked without a host wait, on the first forward of each batch size and on every forward
        while diagnostics are on: the forward's per-layer `written` counts go to the host through pinned memory
        and an event (`SidebandBuffers.stage_written`), and the verdict is read at a later step once the copy is
        complete (at once without streams). So the first stale forward of a batch size still reaches Level 1 (one
        cycle scores stale rows; attention is not affected); from its verdict on, that size skips Level 1 and
        counts `sideband_stale` per forward checked, until a fresh verdict."""
        sb = self.sideband
        if sb is None or n_rows == 0:
            return {}
        self._sideband_verdicts()
        if self.diag_path or n_rows not in self._sideband_checked:
            host, done = sb.stage_written()
            self._sideband_checked.add(n_rows)  # checked once the verdict lands (or re-checked if stale)
            self._sideband_pending.append((n_rows, sb, host, done))
            self._sideband_verdicts()  # without streams: now
        if n_rows in self._sideband_stale:
            return None
        return sb.read(n_rows)

    def _sideband_verdicts(self) -> None:
        """Read the staged `written` counts whose copies are complete (event query, no wait), in order."""
        left = []
        for n_rows, sb, host, done in self._sideband_pending:
            if left or (done is not None and not done.query()):
                left.append((n_rows, sb, host, done))
                continue
            if sb is not self.sideband:
                continue  # the buffers were reallocated meanwhile: that forward's verdict says nothing now
            stale = sb.stale_layers(n_rows, host)
            if not stale:
                self._sideband_stale.discard(n_rows)
                continue
            self._sideband_stale.add(n_rows)
            self._sideband_checked.discard(n_rows)  # checked again at its next forward
            self.count("sideband_stale")
            logger.error(
                "FlashMemory side band: c4 layers %s did not write their inputs in a forward of batch %d; "
                "Level 1 skips that batch size until they do",
                stale,
                n_rows,
            )
        self._sideband_pending = left

    def before_forward(self, forward_batch: Any, req_to_token: torch.Tensor | None = None) -> None:
        """Decode: sync the engine's requests with the batch, then publish each row's resident pages into the
        static Level-2 buffer (read by the graph in score-resident mode)."""
        decode = forward_batch.forward_mode.is_decode()
        self.fwd = self.fwd.next()
        if self.sideband is not None and decode:
            self.sideband.begin_forward()
        if self.engine is not None and not forward_batch.forward_mode.is_idle():
            # The stream this forward is enqueued on (sglang's current one here: forward_stream under overlap,
            # schedule_stream without) goes to the core, whose gate holds Level-1 table writes until after it.
            self.engine.open_forward(decode)  # then (shrink mode) where this forward's c4 stores land
            if not decode and self.engine.extend_reads_reserve and getattr(forward_batch, "rids", None):
                # Its stores are kept (landing -> mirror), but its c4 attention reads the reserve by pool loc.
                # sglang 0.5.23 re-bootstraps retracted DSv4 requests through P, so a PD decode server should
                # never get here; say so loudly if it does.
                self.count("shrink_extend_forwards")
                if self.counters["shrink_extend_forwards"] == 1:
                    logger.error(
                        "FlashMemory shrink: an extend forward with requests %s ran on this decode server; "
                        "its c4 attention reads the reserve and may be wrong. Set SGLANG_PD_B_C4_SHRINK=0 "
                        "if this repeats (counter shrink_extend_forwards)",
                        list(forward_batch.rids)[:4],
                    )
        if self.engine is None or not decode or req_to_token is None:
            return
        rids = list(getattr(forward_batch, "rids", None) or [])
        seq = host_seq_lens(forward_batch, rids)
        dev_seq = (
            forward_batch.seq_lens[: len(rids)] if getattr(forward_batch, "seq_lens_cpu", None) is not None else None
        )
        table = c4_page_table(
            req_to_token, forward_batch.req_pool_indices[: len(rids)], seq, self.pool.page_size, dev_seq
        )
        self.engine.begin_step(rids, table, seq)
        if rids:
            # Before the publish below (allocated at pool attach; never reallocated). Left to the indexer hook's
            # lazy allocation (after the publish), the server's first decode step scored every row's newest page
            # alone: live, a fresh server's first request decoded one token unlike stock's.
            self.level2_buffers(len(rids), req_to_token.device)
        if self.bufs is not None and rids:
            pages = self.engine.step_resident_pages()
            k = min(pages.shape[1], self.bufs.sel_pages.shape[1])
            self.bufs.back_pages[: len(rids)].fill_(-1)
            self.bufs.back_pages[: len(rids), :k] = pages[:, :k].to(self.bufs.back_pages.device)
            self.bufs.publish()
            self.fwd.pool_rows = self.pool_rows()

    def pool_rows(self) -> torch.Tensor | None:
        """Bool [B] on the Level-2 buffers' device: the step's rows whose request has no published Level-1 plan yet,
        which attend their whole c4 history from sglang's pool this forward (the indexer sees stock's view, the
        picks stay pool locs, attention reads the pool; the other rows read only their resident pages there, the
        same bytes as their reserve copies). Before its first plan a request would otherwise decode with its warm
        start alone (the newest KMAX pages), and its first answer tokens could not see a needle further back.

        None (every row reads the reserve) when no row is unplanned, or the mode cannot: shrink mode (the history
        is in host DRAM), a decode CUDA graph (it bakes the reserve read in: such a request keeps its warm start
        until the first plan), mask mode (its mask is per pool loc, not per row). Host flags only; the upload is
        staged (`streams.like`), no host wait."""
        eng = self.engine
        if eng is None or not eng.pool_before_plan or self.on("cudagraph") or self.on("mask"):
            return None
        rows = eng.unplanned_rows()
        if not any(rows):
            return None
        return streams.like(torch.tensor(rows, dtype=torch.bool), self.bufs.sel_pages)

    def admission_refusals(self, forward_batch: Any) -> list[tuple[str, str]]:
        """(rid, reason) of the decode batch's new requests the adapter cannot admit (see
        `OffloadAdapter.admission_refusals`); [] without an adapter or outside decode."""
        if self.engine is None or not forward_batch.forward_mode.is_decode():
            return []
        rids = [str(r) for r in (getattr(forward_batch, "rids", None) or [])]
        return self.engine.admission_refusals(rids, host_seq_lens(forward_batch, rids)) if rids else []

    def after_decode_forward(self, forward_batch: Any) -> None:
        """Hand the step to Level 1 (its own cadence, worker thread and generation checks), export stats.

        Level 1 reads the static side band (views of the real rows; it clones what its job keeps on this stream,
        before the next forward is launched), never a tensor captured inside the forward."""
        self.steps += 1
        if self.engine is None:
            return
        self.engine.close_forward()  # the forward is enqueued: Level-1 table writes may land now
        # Shrink mode: this step's new c4 entries, reserve -> mirror, now: a finished request's pages are freed
        # when sglang processes this batch's result, and a PD transfer may land in those mirror pages next.
        self.engine.settle()
        snapshot = self.sideband_snapshot(len(getattr(forward_batch, "rids", None) or []))
        if snapshot is not None:
            self.engine.level1(snapshot)
        if self.exporter is not None:  # the export runs on its own thread: nothing is read here
            self.exporter.kick(full=self.steps % self.env.interval == 0)

    def after_extend_forward(self) -> None:
        """Shrink mode: the extend's landing cells -> the mirror."""
        if self.engine is not None:
            self.engine.close_forward()
            self.engine.end_extend()


RUNTIME = Runtime()
