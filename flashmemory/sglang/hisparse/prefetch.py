"""HiSparse prefetch mode (SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1): hinted compressed positions are copied into
sglang's DeepSeek-V4 HiSparse hot buffer after each c4 layer's own swap-in, so later steps' top-k find them there.

sglang's HiSparse stays exact and in charge: the indexer still scores the whole history, its on-demand swap-in
still loads every miss, and a prefetch is the same swap-in op called on a hint (see
`cpu/ops/hisparse_prefetch.py` for the invariants that keep the current step's picks and the bytes intact).

Flow (docs/hisparse.md, section 9):
- A hint source calls `state().set_hint(request id, positions)` once per cycle: positions in priority order;
  they are deduplicated and capped at the cycle budget (<= H-K per request). `resident_hint` turns a Level-1
  resident set (pages) into such a list, without the recency tail.
- `before_forward` (decode, the forward's own stream): each row of the batch takes its next `W` pending positions
  (each hinted position is published once) into the static `pf_pos[max_rows, W]`; `pf_active` = rows, or 0 when
  no row has any (every prefetch call then returns at once).
- `around_swap_in` (after `HiSparseCoordinator.swap_in_selected_pages` of a layer): on CPU, attribute the demand
  swap-in's hits on prefetched slots, then prefetch the layer synchronously; on a GPU, fork a low-priority side
  stream from the current one (the indexer's), sanitize into a static buffer and call sglang's kernel there
  with a scratch output, so the copy overlaps the following layers.
- `around_model_forward` joins the side stream into the forward's stream before the forward returns (inside a
  CUDA-graph capture too), so nothing of a prefetch is in flight when a request slot or its locs are recycled;
  `before_destroy` synchronizes it.
The state (`state()`, hint queues, static buffers, counters `PrefetchCounter`) is in `state.py`;
counters are exported as `flashmemory_hisparse_prefetch_*`; hit attribution is CPU only.
With SGLANG_RETRIEVER_INLINE_CKPT set, Level 1 is the hint source (`hint.HintSource`, built after the
coordinator): `around_indexer` copies the retriever layers' indexer inputs into the side band, `after_forward`
hands each decode step to Level 1, whose cycles call `set_hint` through `resident_hint`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from flashmemory.sglang.cpu.ops.hisparse_prefetch import prefetch_layer_cpu, sanitize_hint
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.hisparse.state import resident_hint, state
from flashmemory.sglang.plumbing.patch_spec import Patch
from flashmemory.sglang.plumbing.targets import C4_INDEXER

logger = logging.getLogger(f"sglang.{__name__}")
_M = "flashmemory.sglang.hisparse.prefetch"
_CO = "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_IDX = "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin"


def hint() -> Any:
    """`hint.HintSource` when Level 1 is the hint source (`RUNTIME.hisparse.hint`); None: hints come
    from `set_hint` callers."""
    return RUNTIME.hisparse.hint


def _env() -> Any:
    return RUNTIME.env


def enabled() -> bool:
    return bool(getattr(_env(), "hisparse_prefetch", False))


# --- hooks ----------------------------------------------------------------------------------------------------


def after_init_hisparse(result: Any, self: Any) -> None:
    """After `ModelRunner.maybe_init_hisparse_coordinator` (model_runner.py:1029): refuse without HiSparse on
    DeepSeek-V4, else allocate the mode's buffers and side stream (before any CUDA-graph capture)."""
    from flashmemory.sglang.plumbing.patching import StartupError

    co = getattr(self, "hisparse_coordinator", None)
    if co is None or not getattr(co, "is_dsv4_hisparse", False):
        raise StartupError(
            "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1 needs sglang's HiSparse on DeepSeek-V4 "
            "(--enable-hisparse on the PD decode server); unset it or enable HiSparse"
        )
    if getattr(co, "enable_prefetch", False):
        raise StartupError(
            "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1 with sglang's shared-index prefetch on: one writer "
            "per layer's hot buffer; set SGLANG_DISABLE_HISPARSE_PREFETCH=1 or unset the first"
        )
    env, st = _env(), state()
    st.configure(
        int(co.device_buffer_size),
        int(co.top_k),
        int(co.req_device_buffer_tokens.shape[1]),
        int(co.req_device_buffer_tokens.shape[0]),
        co.req_device_buffer_tokens.device,
        env.hisparse_prefetch_width,
        env.hisparse_prefetch_budget,
    )
    logger.info(
        "FlashMemory HiSparse prefetch: H=%d K=%d, %d positions per request per step, %d per cycle",
        co.device_buffer_size,
        co.top_k,
        st.width,
        st.budget,
    )
    if env.retriever_ckpt:
        _build_hint(self, env, int(co.top_k))


def _build_hint(runner: Any, env: Any, top_k: int) -> None:
    """Level 1 over the runner's c4 index-K pool, its cycles publishing hints (newest top_k entries left out)."""
    from flashmemory.sglang.decode.retriever_load import load_serving_retriever, place_retriever, served_model_path
    from flashmemory.sglang.decode.runtime import server_args
    from flashmemory.sglang.hisparse.hint import HintSource

    pool = runner.token_to_kv_pool
    retriever = RUNTIME.retriever or load_serving_retriever(env, served_model_path(server_args(), []))
    from flashmemory.sglang.decode.geometry import pool_buffers

    retriever = place_retriever(retriever, pool_buffers(pool)[1][0].device)
    RUNTIME.sideband_rows_hint = max(RUNTIME.sideband_rows_hint, int(getattr(runner, "max_running_requests", 0) or 0))
    if RUNTIME.hisparse.hint is not None:
        RUNTIME.hisparse.hint.close()
    pc, st = int(pool.c4_kv_pool.page_size), state()
    RUNTIME.hisparse.hint = HintSource(
        pool, env, retriever, lambda rid, pages, n: st.set_hint(rid, resident_hint(pages, n, top_k, pc))
    )
    logger.info(
        "FlashMemory HiSparse prefetch: Level 1 is the hint source (c4 layers %s, every %d steps)",
        list(env.retriever_layers),
        env.interval,
    )


def before_forward(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> None:
    """Before `ModelRunner.forward`: publish the hints of a decode batch (rows in its order); other forwards
    prefetch nothing."""
    if getattr(self, "is_draft_worker", False):
        return
    st = state()
    if forward_batch.forward_mode.is_decode():
        st.publish([str(r) for r in (getattr(forward_batch, "rids", None) or [])])
        if hint() is not None and RUNTIME.sideband is not None:
            RUNTIME.sideband.begin_forward()  # a layer that does not write this forward reads as stale
    elif st.pf_active is not None:
        st.active = 0
        st.pf_active.fill_(0)


def around_indexer(
    original: Callable,
    self: Any,
    x: torch.Tensor,
    q_lora: torch.Tensor,
    c4_indexer: Any,
    forward_batch: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """`C4IndexerBackendMixin.forward_c4_indexer` (indexer.py:774), unchanged; with Level 1 as the hint source,
    a decode step's retriever-layer input x [B, hidden] and positions [B] are first copied into the side band."""
    mode = forward_batch.forward_mode
    if hint() is not None and mode.is_decode() and not mode.is_idle():
        layer = RUNTIME.c4_layer(self.token_to_kv_pool, c4_indexer.layer_id)
        if layer in RUNTIME.env.retriever_layers:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            RUNTIME.capture_sideband_input(layer, x, self.forward_metadata.core_metadata.positions, capturing)
    return original(self, x, q_lora, c4_indexer, forward_batch, *args, **kwargs)


def after_forward(result: Any, self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> None:
    """After `ModelRunner.forward` of a decode batch: the step goes to Level 1 (rows, c4 page tables, the side
    band's view of the real rows); its due cycles publish hints, on its worker thread by default."""
    src = hint()
    if src is None or getattr(self, "is_draft_worker", False) or not forward_batch.forward_mode.is_decode():
        return
    from flashmemory.sglang.decode.tables import c4_page_table, host_seq_lens

    rids = [str(r) for r in (getattr(forward_batch, "rids", None) or [])]
    seq = host_seq_lens(forward_batch, rids)
    table = c4_page_table(
        self.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices[: len(rids)],
        seq,
        self.token_to_kv_pool.page_size,
    )
    src.on_decode(rids, table, seq, RUNTIME.sideband_snapshot(len(rids)))


def _gpu_swap_in(**kw: Any) -> None:
    """sglang's swap-in kernel (kernels/ops/kvcache/hisparse.py:522), called directly."""
    from sglang.kernels.ops.kvcache.hisparse import load_cache_to_device_buffer_dsv4_mla

    load_cache_to_device_buffer_dsv4_mla(**kw)


def _prefetch_gpu(co: Any, req_pool_indices: torch.Tensor, lens: torch.Tensor, layer_id: int, bs: int) -> None:
    st = state()
    st.stream.wait_stream(torch.cuda.current_stream())  # after this layer's own swap-in (I4)
    with torch.cuda.stream(st.stream):
        st.pf_clean[:bs].copy_(sanitize_hint(st.pf_pos[:bs], req_pool_indices, lens, co.req_to_host_pool))
        _gpu_swap_in(
            top_k_tokens=st.pf_clean[:bs],
            device_buffer_tokens=co.req_device_buffer_tokens[layer_id],
            host_cache_locs=co.req_to_host_pool,
            device_buffer_locs=co.req_device_buffer_token_locs[layer_id],
            host_cache=co.mem_pool_host.kv_buffer[layer_id],
            device_buffer=co.mem_pool_device.kv_buffer[layer_id],
            top_k_device_locs=st.scratch[:bs],
            req_pool_indices=req_pool_indices,
            seq_lens=lens,
            lru_slots=co.lru_slots[layer_id],
            item_size_bytes=co.item_size_bytes,
            num_top_k=st.width,
            hot_buffer_size=co.device_buffer_size,
            page_size=1,
            block_size=co.swap_in_block_size,
            num_real_reqs=st.pf_active,
        )


def _prefetch_cpu(
    co: Any, req_pool_indices: torch.Tensor, lens: torch.Tensor, picks: torch.Tensor, layer_id: int, bs: int
) -> None:
    st = state()
    real = min(bs, int(co.num_real_reqs.reshape(-1)[0]))
    tokens = co.req_device_buffer_tokens[layer_id]
    a = st.provenance.after_demand(layer_id, picks, req_pool_indices, tokens, real)
    step = {"used": a.used, "wasted": a.wasted}
    if st.active:
        before = tokens[req_pool_indices[:real].long()].cpu().to(torch.int32)
        c = prefetch_layer_cpu(
            st.pf_pos,
            tokens,
            co.req_to_host_pool,
            co.req_device_buffer_token_locs[layer_id],
            co.mem_pool_host.kv_buffer[layer_id],
            co.mem_pool_device.kv_buffer[layer_id],
            st.scratch,
            req_pool_indices,
            lens,
            co.lru_slots[layer_id],
            int(co.device_buffer_size),
            min(real, st.active),
        )
        step["wasted"] += st.provenance.after_prefetch(layer_id, before, req_pool_indices, tokens, real)
        step.update(
            calls=1, positions=c.listed, resident=c.resident, loaded=c.loaded, bytes_h2d=c.bytes_h2d, dropped=c.dropped
        )
    st.counts.add(**step)


def around_swap_in(
    original: Callable,
    self: Any,
    req_pool_indices: torch.Tensor,
    compressed_seq_lens: torch.Tensor,
    top_k_result: torch.Tensor,
    layer_id: int,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """`HiSparseCoordinator.swap_in_selected_pages` (hisparse_coordinator.py:1587), then this layer's prefetch
    (decode, 2-D top-k, DSv4 HiSparse, sglang's shared-index prefetch off)."""
    out = original(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id, *args, **kwargs)
    st = state()
    if (
        st.pf_pos is None
        or top_k_result.ndim != 2
        or not getattr(self, "is_dsv4_hisparse", False)
        or getattr(self, "enable_prefetch", False)
    ):
        return out
    bs = int(req_pool_indices.shape[0])
    if st.stream is not None:
        _prefetch_gpu(self, req_pool_indices, compressed_seq_lens, layer_id, bs)
    else:
        _prefetch_cpu(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id, bs)
    return out


def around_model_forward(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """`DeepseekV4Model.forward` (deepseek_v4.py:4399), then the join: the forward's stream waits for every
    prefetch it forked (I10; inside a capture, an unjoined fork would invalidate the graph)."""
    out = original(self, *args, **kwargs)
    st = state()
    if st.stream is not None:
        torch.cuda.current_stream().wait_stream(st.stream)
    return out


def after_request_finished(result: Any, self: Any, req: Any) -> None:
    """After `HiSparseCoordinator.request_finished` (:1402): forget the request's hint and its prefetched marks
    (counted wasted when never used)."""
    st, src = state(), hint()
    st.drop(str(getattr(req, "rid", "")))
    if src is not None:
        src.forget(str(getattr(req, "rid", "")))
    if st.provenance is not None:
        wasted = st.provenance.release(int(req.kv.req_pool_idx))
        if wasted:
            st.counts.add(wasted=wasted)


def before_destroy(self: Any, *args: Any, **kwargs: Any) -> None:
    """Before `HiSparseCoordinator.destroy` (:811): no prefetch copy may still read the host pool."""
    st, src = state(), hint()
    if st.stream is not None:
        st.stream.synchronize()
    if src is not None:
        src.l1.wait()  # no cycle reads sglang's index-K pool past this point


WHY = "hisparse_coordinator.py"
PREFETCH_PATCHES: tuple[Patch, ...] = (
    Patch(
        "hisparse_prefetch",
        f"{_MR}.maybe_init_hisparse_coordinator",
        "after",
        f"{_M}:after_init_hisparse",
        ("self",),
        "model_runner.py:1029 the coordinator exists: refuse without DSv4 HiSparse, allocate the "
        "prefetch buffers and side stream before capture",
    ),
    Patch(
        "hisparse_prefetch",
        f"{_MR}.forward",
        "before",
        f"{_M}:before_forward",
        ("self", "forward_batch"),
        "model_runner.py:1813 publish this decode batch's hint rows into the static buffer",
    ),
    Patch(
        "hisparse_prefetch",
        f"{_MR}.forward",
        "after",
        f"{_M}:after_forward",
        ("self", "forward_batch"),
        "model_runner.py:1813 a decode step goes to Level 1, the hint source",
    ),
    Patch(
        "hisparse_prefetch",
        f"{_IDX}.forward_c4_indexer",
        "around",
        f"{_M}:around_indexer",
        C4_INDEXER,
        "indexer.py:774 the retriever layers' indexer inputs into Level 1's side band",
    ),
    Patch(
        "hisparse_prefetch",
        f"{_CO}.swap_in_selected_pages",
        "around",
        f"{_M}:around_swap_in",
        ("self", "req_pool_indices", "compressed_seq_lens", "top_k_result", "layer_id"),
        f"{WHY}:1587 after each c4 layer's own swap-in, the same op on the hint (side stream on a GPU)",
    ),
    Patch(
        "hisparse_prefetch",
        "sglang.srt.models.deepseek_v4.DeepseekV4Model.forward",
        "around",
        f"{_M}:around_model_forward",
        ("self", "input_ids", "positions", "forward_batch"),
        "deepseek_v4.py:4399 join the prefetch stream before the forward returns",
    ),
    Patch(
        "hisparse_prefetch",
        f"{_CO}.request_finished",
        "after",
        f"{_M}:after_request_finished",
        ("self", "req"),
        f"{WHY}:1402 a finished request's hint and prefetch marks are dropped",
    ),
    # Not on CPU (SGLANG_FLASHMEMORY_CPU=1): the CPU layer hooks destroy first, and sglang's HookRegistry applies
    # a target once; there the prefetch runs inline (no stream to drain) and Level 1's worker is a daemon thread.
    Patch(
        "hisparse_prefetch_sync",
        f"{_CO}.destroy",
        "before",
        f"{_M}:before_destroy",
        ("self",),
        f"{WHY}:811 the prefetch stream is drained before the host pool goes",
    ),
)
