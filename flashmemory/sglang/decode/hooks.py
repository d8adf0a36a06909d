"""The hook callables registered with sglang's HookRegistry (see `targets.SPECS`). Glue only: each one reads
sglang objects, calls the plain tensor functions in `resident_topk` or the state in `runtime.RUNTIME`, and returns.
Every hook runs under `RUNTIME.guard` (wrapped at the bottom of this module): a failure costs one request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from flashmemory.sglang.decode.guard import RequestFailure, batch_rids, guarded
from flashmemory.sglang.decode.resident_topk import apply_resident_mask, pad_rows, resident_view
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.decode.server import scheduler_idle
from flashmemory.sglang.decode.tables import substitute_buf_infos

logger = logging.getLogger(__name__)


def _capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (host syncs are illegal then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _resident_metadata(md: Any, layer: int) -> Any:
    """Score-resident: the forward's indexer metadata with the resident page table and lengths.

    Built by the first c4 layer of each forward and reused by the later ones. The cache holds `md` itself
    (not its id, which CPython reuses once the old metadata is freed) and the c4 layer that built it; a
    layer that does not come after that one starts a new forward (also each CUDA-graph warmup and capture
    run, so the capture records the view's computation instead of baking in a warmup-time tensor).
    """
    cache = RUNTIME.fwd.view_cache
    if cache is not None and cache[0] is md and layer > cache[1]:
        return cache[2]
    bs = md.page_table.shape[0]
    RUNTIME.level2_buffers(bs, md.page_table.device)  # allocated once, before capture; never reallocated
    full = RUNTIME.fwd.pool_rows
    table, lens = resident_view(
        md.page_table,
        md.compressed_seq_lens.reshape(-1)[:bs],
        RUNTIME.bufs.sel_pages[:bs],
        full=None if full is None else pad_rows(full, bs),
    )
    # dataclasses.replace reruns __post_init__, which rebuilds the DeepGEMM schedule and top-k plan for the view.
    view = dataclasses.replace(md, page_table=table, compressed_seq_lens=lens)
    RUNTIME.fwd.view_cache = (md, layer, view)
    return view


def _resident_block_metadata(md: Any, layer: int) -> Any:
    """Score-resident view for a layer whose index-K lives in the Path-I reserve: the same columns as
    `_resident_metadata`, with the page table mapped to reserve blocks (so top-k come out as reserve cells)."""
    cache = RUNTIME.fwd.block_view_cache
    if cache is not None and cache[0] is md and layer > cache[1]:
        return cache[2]
    view = _resident_metadata(md, layer)
    blocks = dataclasses.replace(view, page_table=RUNTIME.engine.block_table(view.page_table))
    RUNTIME.fwd.block_view_cache = (md, layer, blocks)
    return blocks


def around_forward_c4_indexer(
    original: Callable,
    self: Any,
    x: torch.Tensor,
    q_lora: torch.Tensor,
    c4_indexer: Any,
    forward_batch: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    mode = forward_batch.forward_mode
    if mode.is_idle() or not mode.is_decode():
        RUNTIME.fwd.decode_active = False
        return original(self, x, q_lora, c4_indexer, forward_batch, *args, **kwargs)
    pool = self.token_to_kv_pool
    layer = RUNTIME.c4_layer(pool, c4_indexer.layer_id)
    meta = self.forward_metadata
    md = meta.indexer_metadata
    RUNTIME.fwd.decode_active = True
    capturing = _capturing()
    RUNTIME.count("indexer_calls_captured" if capturing else "indexer_calls_eager")
    if RUNTIME.on("level1") and layer in RUNTIME.env.retriever_layers:
        # In-place copy into the static side band: recorded into the graph, so it replays every step.
        RUNTIME.capture_sideband_input(
            layer,
            x,
            meta.core_metadata.positions,
            capturing,
            q_lora,
            c4_indexer,
            kwargs.get("q_lora_ready", args[2] if len(args) > 2 else None),
        )
    engine = RUNTIME.engine
    picks_are_cells = engine is not None and engine.index_in_reserve(layer)
    if picks_are_cells:  # Path-I in the reserve (implies score-resident): the table holds reserve blocks
        meta.indexer_metadata = _resident_block_metadata(md, layer)
        try:
            out = original(self, x, q_lora, c4_indexer, forward_batch, *args, **kwargs)
        finally:
            meta.indexer_metadata = md
    elif RUNTIME.on("level2") and RUNTIME.env.score_resident:
        meta.indexer_metadata = _resident_metadata(md, -1 if layer is None else layer)
        try:
            out = original(self, x, q_lora, c4_indexer, forward_batch, *args, **kwargs)
        finally:
            meta.indexer_metadata = md
    elif RUNTIME.on("mask") and engine is not None:
        RUNTIME.fwd.mask_resident = engine.resident_mask
        try:
            out = original(self, x, q_lora, c4_indexer, forward_batch, *args, **kwargs)
        finally:
            RUNTIME.fwd.mask_resident = None
    else:
        out = original(self, x, q_lora, c4_indexer, forward_batch, *args, **kwargs)
    if picks_are_cells:
        meta.core_metadata.c4_sparse_page_indices = engine.drop_sink(meta.core_metadata.c4_sparse_page_indices)
    elif engine is not None and RUNTIME.fwd.pool_rows is not None:
        # Attention reads sglang's pool this forward (`Runtime.pool_rows`): the picks stay pool locs.
        picks = meta.core_metadata.c4_sparse_page_indices
        full = pad_rows(RUNTIME.fwd.pool_rows, picks.shape[0])
        meta.core_metadata.c4_sparse_page_indices = engine.pool_picks(picks, full)
    elif engine is not None:
        # Attention reads the reserve (get_extra_key_buffer below), so the picks become reserve cells.
        meta.core_metadata.c4_sparse_page_indices = engine.cells_of(meta.core_metadata.c4_sparse_page_indices)
    if RUNTIME.dump is not None and layer is not None:
        _dump_observe(self, x, q_lora, c4_indexer, forward_batch, layer, md, meta)
    return out


def _dump_observe(
    backend: Any,
    x: torch.Tensor,
    q_lora: torch.Tensor,
    c4_indexer: Any,
    forward_batch: Any,
    layer: int,
    md: Any,
    meta: Any,
) -> None:
    """Recompute this layer's native logits (q, weights are locals of the indexer) and hand them to the recorder."""
    from flashmemory.retriever.fp8 import pages_to_chunks
    from flashmemory.sglang.decode.resident_topk import paged_index_scores

    rec = RUNTIME.dump
    rids = list(forward_batch.rids or [])
    if layer == 0:
        rec.begin_step(rids)
    if not rec.docs:
        return
    bs = len(rids)
    positions = meta.core_metadata.positions[:bs]
    weights = c4_indexer.compute_weights(x[:bs], skip_scale=True)
    q, w = c4_indexer.compute_q(q_lora[:bs], positions, weights)
    q = q[0] if isinstance(q, tuple) else q
    kv = backend.token_to_kv_pool.get_index_k_with_scale_buffer(layer_id=c4_indexer.layer_id)
    seq = md.compressed_seq_lens.reshape(-1)[:bs]
    logits = paged_index_scores(q.float(), w.reshape(bs, -1).float(), kv, md.page_table[:bs], seq)
    logits = logits.masked_fill(torch.arange(logits.shape[1], device=logits.device) >= seq.unsqueeze(1), float("-inf"))

    def new_chunks(b: int, start: int, stop: int) -> torch.Tensor:
        n_pages = -(-stop // 64)
        rows = kv[md.page_table[b, :n_pages].long()]
        return pages_to_chunks(rows, stop, kv.shape[1] // 64 - 4)[start:stop]

    rec.observe_layer(layer, rids, logits, seq, positions, hidden=x[:bs], new_chunks=new_chunks)


def around_topk(
    original: Callable,
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    *args: Any,
    **kwargs: Any,
) -> Any:
    resident = RUNTIME.fwd.mask_resident
    if resident is not None and scores.dtype == torch.float32:
        apply_resident_mask(scores, page_tables, resident, page_size)
    return original(scores, seq_lens, page_tables, out_page_indices, page_size, *args, **kwargs)


def after_pool_init(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    RUNTIME.attach_pool(self)
    if RUNTIME.engine is not None:
        RUNTIME.guard.watch_scores(RUNTIME.engine)  # a non-finite retriever score fails its request, not the server
        RUNTIME.engine.make_failure = RequestFailure  # so does a disk-tier page failing verification in a recall


def around_attention(
    original: Callable,
    self: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: Any,
    forward_batch: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """DeepseekV4AttnBackend.forward: the only scope in which the c4 cache is read through the reserve.

    On CUDA the core compressor writes the new c4 entry straight into `get_extra_key_buffer(layer)` (compressor_v2
    forward_unified -> _forward_compress_all_in_one), after the indexer and before attention, so the buffer must
    stay the pool outside this scope. Here, after that store, the entries this step closed are copied from the
    pool into their reserve cells (graph safe), then attention reads the reserve with the remapped top-k."""
    engine = RUNTIME.engine
    pool = getattr(self, "token_to_kv_pool", None)
    if engine is None or pool is not RUNTIME.pool or not forward_batch.forward_mode.is_decode():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    c4 = RUNTIME.c4_layer(pool, layer.layer_id)
    if c4 is None:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    out_loc = getattr(self.forward_metadata.core_metadata, "c4_out_loc", None)
    if out_loc is not None:
        engine.refresh_from_pool(c4, out_loc)
    RUNTIME.fwd.attn_layer = c4
    try:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        RUNTIME.fwd.attn_layer = None


def around_get_extra_key_buffer(original: Callable, self: Any, layer_id: int, *args: Any, **kwargs: Any) -> Any:
    buf = original(self, layer_id, *args, **kwargs)  # also waits for this layer's transfer, as stock does
    engine = RUNTIME.engine
    if engine is not None and self is RUNTIME.pool and RUNTIME.fwd.attn_layer is not None:
        layer = RUNTIME.c4_layer(self, layer_id)
        if layer is not None and layer == RUNTIME.fwd.attn_layer:
            if RUNTIME.fwd.pool_rows is not None:  # a row before its first plan: this forward reads the pool
                RUNTIME.count("pool_reads_before_plan")
                return buf
            RUNTIME.count("reserve_reads_captured" if _capturing() else "reserve_reads_eager")
            # The pool hands out its uint8 page rows viewed as the KV dtype (fp8); so must the reserve.
            return engine.reserve_kv(layer).view(buf.dtype)
    return buf


def after_set_extra_key(result: Any, self: Any, layer_id: int, loc: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    # Only the HIP / trtllm / V4.1 store paths call this; the CUDA flashmla path writes the buffer in-kernel.
    # The copy syncs the host, so it is skipped under capture; `begin_step` settles those chunks a step later.
    engine = RUNTIME.engine
    if engine is not None and self is RUNTIME.pool and not _capturing():
        layer = RUNTIME.c4_layer(self, layer_id)
        if layer is not None:
            engine.on_c4_store(layer, loc)


def around_contiguous_buf_infos(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    infos = original(self, *args, **kwargs)
    if RUNTIME.engine is not None and self is RUNTIME.pool:
        return substitute_buf_infos(infos, RUNTIME.engine.mirror_buf_infos())
    return infos


def around_get_index_k(original: Callable, self: Any, layer_id: int, *args: Any, **kwargs: Any) -> Any:
    engine = RUNTIME.engine
    if engine is not None and self is RUNTIME.pool and RUNTIME.fwd.decode_active:
        layer = RUNTIME.c4_layer(self, layer_id)
        if layer is not None and layer not in RUNTIME.env.retriever_layers:
            buf = engine.reserve_index(layer)
            if buf is not None:
                return buf
    return original(self, layer_id, *args, **kwargs)


def after_set_index_k(result: Any, self: Any, layer_id: int, loc: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    # Every c4 layer: target layers feed Level 1's keys, the others the Path-I mirror. Not called on the CUDA
    # flashmla path (the indexer compressor writes in-kernel); `begin_step` settles the chunks from the pool.
    engine = RUNTIME.engine
    if engine is not None and self is RUNTIME.pool and not _capturing():
        layer = RUNTIME.c4_layer(self, layer_id)
        if layer is not None:
            engine.on_index_store(layer, loc)


def before_init_cuda_graphs(self: Any, *args: Any, **kwargs: Any) -> None:
    """Before capture: size the Level-1 side band for the largest decode batch (it is allocated by the first
    eager warmup, which precedes every capture) and allocate the Level-2 static buffers so the graph bakes them in."""
    if getattr(self, "is_draft_worker", False):
        return
    sa = self.server_args
    running = int(getattr(self, "max_running_requests", None) or getattr(sa, "max_running_requests", None) or 0)
    RUNTIME.check_refusals(running)  # the model runner's resolved --max-running-requests against the core's rows
    max_bs = max(int(getattr(sa, "cuda_graph_max_bs_decode", None) or 0), running) or 256
    if RUNTIME.on("level1"):
        RUNTIME.sideband_rows_hint = max_bs
    if not RUNTIME.on("cudagraph"):
        return
    RUNTIME.level2_buffers(max_bs, self.device)  # the same buffers the pool attach sized, or sized here once


def before_forward(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> None:
    if not getattr(self, "is_draft_worker", False):
        r2t = getattr(getattr(self, "req_to_token_pool", None), "req_to_token", None)
        RUNTIME.before_forward(RUNTIME.guard.without_failed(forward_batch), r2t)  # failed requests: rows released


def after_forward(result: Any, self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> None:
    if getattr(self, "is_draft_worker", False):
        return
    mode = forward_batch.forward_mode
    if mode.is_decode():
        RUNTIME.after_decode_forward(forward_batch)  # marks the metrics export due (it runs on its own thread)
        RUNTIME.guard.idle_published = False
    elif not mode.is_idle():
        RUNTIME.after_extend_forward()


def before_add_request(self: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    if RUNTIME.dump is None:
        return
    try:
        RUNTIME.dump.admit(req.rid, getattr(req.sampling_params, "custom_params", None))
    except ValueError as e:  # a bad dump block: the client gets HTTP 400 with the reason (sglang's own abort path)
        abort = getattr(req, "set_finish_with_abort", None)
        if abort is None:
            logger.error("FlashMemory dump: %s; the request runs without dumping", e)
        else:
            abort(f"FlashMemory dump: {e}")


def before_process_batch_result(self: Any, batch: Any, result: Any, *args: Any, **kwargs: Any) -> None:
    """Scheduler.process_batch_result: requests failed during this batch's forward finish with an abort now."""
    RUNTIME.guard.abort_failed(list(getattr(batch, "reqs", None) or []))


def after_on_idle(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """Scheduler.on_idle: flush dump documents; with nothing running, release the engine rows of requests that
    finished after the last decode forward (normally released by the next `begin_step`) and publish the gauges
    once, so /metrics says idle (live requests 0, every reserve block free, no mirror bytes)."""
    if RUNTIME.dump is not None and RUNTIME.dump.docs:
        RUNTIME.dump.flush_all()
    engine = RUNTIME.engine
    if engine is None or not scheduler_idle(self):
        return
    if engine.rows:
        engine.close_forward()  # a forward that raised never released the gate the worker waits for
        engine.l1.wait()  # a Level-1 cycle in flight publishes (or is discarded) first
        engine.begin_step([], torch.empty((0, 1), dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        RUNTIME.guard.idle_published = False
    RUNTIME.guard.forget_all()
    if not RUNTIME.guard.idle_published and RUNTIME.exporter is not None:
        RUNTIME.exporter.kick(full=True)
        RUNTIME.exporter.flush()  # here, at idle: /metrics says idle before the next request
        RUNTIME.guard.idle_published = True


# --- the guard: every hook above, wrapped once (name = the HookSpec's hook) ------------------------------
# Where each hook's forward batch sits (HookRegistry passes (original, *args) to around hooks, (result, *args) to
# after hooks), so the injector and the guard know the batch's request ids.
_GUARDED: dict[str, Any] = {
    "around_forward_c4_indexer": batch_rids(5),
    "around_topk": None,
    "after_pool_init": None,
    "around_attention": batch_rids(6),
    "around_get_extra_key_buffer": None,
    "after_set_extra_key": None,
    "around_contiguous_buf_infos": None,
    "around_get_index_k": None,
    "after_set_index_k": None,
    "before_init_cuda_graphs": None,
    "before_forward": batch_rids(1),
    "after_forward": batch_rids(2),
    "before_add_request": lambda a, k: [str(getattr(a[1] if len(a) > 1 else k.get("req"), "rid", ""))],
    "before_process_batch_result": None,
    "after_on_idle": None,
}
HOOK_NAMES = tuple(_GUARDED)


def _admission_precheck(args: tuple, kwargs: dict) -> list[tuple[str, str]]:
    """Run by the guard before `before_forward`'s body: (rid, reason) of new requests the adapter cannot admit
    (no free row, host mirror full). They fail alone; the body then sees the batch without them."""
    runner = args[0] if args else None
    fb = args[1] if len(args) > 1 else kwargs.get("forward_batch")
    if fb is None or getattr(runner, "is_draft_worker", False):
        return []
    return RUNTIME.admission_refusals(RUNTIME.guard.without_failed(fb))


RUNTIME.guard.precheck = _admission_precheck
for _name, _rids in _GUARDED.items():
    globals()[_name] = guarded(_name, _rids, RUNTIME)(globals()[_name])
