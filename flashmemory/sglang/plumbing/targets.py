"""The hook table: where FlashMemory hooks into sglang 0.5.23 (one `Patch` per target and hook kind).

Each row names its feature (`features_for` turns an env into the active ones), the target, the hook kind,
the hook callable in `flashmemory.sglang.decode.hooks`, the leading parameter names the hook reads (by position and
name; a rename upstream must fail loudly, not bind the wrong argument), and the sglang file:line it covers.
`flashmemory.sglang.plumbing.patching` applies it with every other table; importing this module imports no sglang.
"""

from __future__ import annotations

from typing import Any

from flashmemory.sglang.plumbing.patch_spec import Patch

_IDX = "sglang.srt.layers.attention.dsv4.indexer"
_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_ATTN = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend"
_NIXL = "sglang.srt.disaggregation.nixl.conn"
_COMP = "sglang.srt.layers.attention.dsv4.compressor_v2"
_CFG = "sglang.srt.model_executor.pool_configurator"
_RESOLVE_LAST = "sglang.srt.arg_groups.moe_hook.validate_deepep_v2_dispatch_token_budget"  # pipeline.py's last step
_H = "flashmemory.sglang.decode.hooks"
_S = "flashmemory.sglang.decode.shrink_hooks"  # shrink mode's hooks
SHRINK_HOOKS = (
    "around_init_compressed_pools",
    "around_make_kv_pool",
    "around_c4_bytes_per_token",
    "before_nixl_manager_init",
    "around_compress",
)
_P = "srt/mem_cache/deepseek_v4_memory_pool.py"

TOPK = ("scores", "seq_lens", "page_tables", "out_page_indices", "page_size")
C4_INDEXER = ("self", "x", "q_lora", "c4_indexer", "forward_batch")
WHY_C4 = "srt/layers/attention/dsv4/indexer.py:774 C4 indexer forward: Level 2 (mask / score-resident), dump recorder"
WHY_TOPK = "top-k over the C4 scores: mask mode restricts it to the resident pages"


def _h(feature: str, target: str, kind: str, params: tuple[str, ...], hook: str, why: str) -> Patch:
    mod = _S if hook in SHRINK_HOOKS else _H
    return Patch(feature, target, kind, f"{mod}:{hook}", params, why)


SPECS: tuple[Patch, ...] = (
    # (1) Level 2 in the C4 indexer (mask mode and score-resident mode), also the dump recorder.
    _h(
        "level2",
        f"{_IDX}.C4IndexerBackendMixin.forward_c4_indexer",
        "around",
        C4_INDEXER,
        "around_forward_c4_indexer",
        WHY_C4,
    ),
    _h(
        "mask",
        f"{_IDX}.topk_transform_paged",
        "around",
        TOPK,
        "around_topk",
        f"kernels/ops/attention/dsv4/topk.py:106 {WHY_TOPK}",
    ),
    _h(
        "mask",
        f"{_IDX}.topk_transform_paged_v2",
        "around",
        TOPK,
        "around_topk",
        f"kernels/ops/attention/dsv4/topk.py:209 {WHY_TOPK}",
    ),
    _h(
        "mask",
        f"{_IDX}.topk_transform_pytorch_vectorized",
        "around",
        TOPK,
        "around_topk",
        f"srt/layers/attention/dsv4/indexer.py:363 {WHY_TOPK} (the torch top-k)",
    ),
    # (2) Path-P / Path-I in the DSv4 memory pool.
    _h(
        "path_p",
        f"{_POOL}.__init__",
        "after",
        ("self", "max_num_reqs", "swa_size", "c4_size", "c128_size"),
        "after_pool_init",
        f"{_P}:948 the pool is built: build the offload adapter beside it",
    ),
    _h(
        "path_p",
        f"{_POOL}.get_extra_key_buffer",
        "around",
        ("self", "layer_id"),
        "around_get_extra_key_buffer",
        f"{_P}:2034 c4 KV read: the device reserve inside attention, the full pool elsewhere",
    ),
    # The reserve is read only inside attention: the core compressor also calls get_extra_key_buffer to store.
    _h(
        "path_p",
        f"{_ATTN}.forward",
        "around",
        ("self", "q", "k", "v", "layer", "forward_batch"),
        "around_attention",
        "srt/layers/attention/deepseek_v4_backend.py:4132 marks 'inside attention' for the c4 KV read",
    ),
    _h(
        "path_p",
        f"{_POOL}.set_extra_key_buffer",
        "after",
        ("self", "layer_id", "loc"),
        "after_set_extra_key",
        f"{_P}:2040 c4 KV written (HIP / trtllm / V4.1 store paths): mirror it to the host",
    ),
    _h(
        "path_p",
        f"{_POOL}.set_extra_key_buffer_fused",
        "after",
        ("self", "layer_id", "loc"),
        "after_set_extra_key",
        f"{_P}:2255 c4 KV written (fused): mirror the new rows to the host",
    ),
    _h(
        "path_p",
        f"{_POOL}.get_contiguous_buf_infos",
        "around",
        ("self",),
        "around_contiguous_buf_infos",
        f"{_P}:1334 PD transfer buffers: the host mirror stands in for the c4 pool",
    ),
    _h(
        "path_p",
        f"{_POOL}.set_index_k_fused",
        "after",
        ("self", "layer_id", "loc"),
        "after_set_index_k",
        f"{_P}:2275 index-K written: mirror it to the host",
    ),
    _h(
        "path_p",
        f"{_MR}.forward",
        "before",
        ("self", "forward_batch"),
        "before_forward",
        "srt/model_executor/model_runner.py:1813 before a forward: settle the step, publish the resident pages",
    ),
    _h(
        "path_p",
        f"{_MR}.forward",
        "after",
        ("self", "forward_batch"),
        "after_forward",
        "srt/model_executor/model_runner.py:1813 after a forward: end the step (Level-1 launch on decode)",
    ),
    _h(
        "path_i",
        f"{_POOL}.get_index_k_with_scale_buffer",
        "around",
        ("self", "layer_id"),
        "around_get_index_k",
        f"{_P}:2083 index-K read during decode: the Path-I reserve",
    ),
    _h(
        "path_i",
        f"{_POOL}.set_index_k_fused",
        "after",
        ("self", "layer_id", "loc"),
        "after_set_index_k",
        f"{_P}:2275 index-K written: mirror it to the host",
    ),
    # Shrink mode (PD decode): no full-size device c4 KV pool, PD lands c4 KV in the host mirror (NIXL DRAM).
    _h(
        "shrink",
        f"{_POOL}._init_compressed_pools",
        "around",
        ("self",),
        "around_init_compressed_pools",
        f"{_P}:1541 no full-size device c4 pool in shrink mode",
    ),
    _h(
        "shrink",
        f"{_POOL}._make_kv_pool",
        "around",
        ("self",),
        "around_make_kv_pool",
        f"{_P}:1652 the c4 pool is built at reserve size in shrink mode",
    ),
    _h(
        "shrink",
        f"{_NIXL}.NixlKVManager.__init__",
        "before",
        ("self", "args", "disaggregation_mode"),
        "before_nixl_manager_init",
        "srt/disaggregation/nixl/conn.py:524 PD decode into the host mirror: its c4 entries register as DRAM",
    ),
    # forward_indexer_compressor and forward_core_compressor are class-level aliases of forward_unified
    # (compressor_v2.py:360-361), bound at class creation: patching forward_unified would not reach the callers
    # (indexer.py:552,592; deepseek_v4.py:1943,2106,2141,2148,2591).
    _h(
        "shrink",
        f"{_COMP}.CompressorBackendMixin.forward_indexer_compressor",
        "around",
        ("self", "x", "forward_batch", "layer_id", "compressor"),
        "around_compress",
        "srt/layers/attention/dsv4/compressor_v2.py:155,360 a Path-I layer's indexer compressor stores at "
        "reserve cells",
    ),
    _h(
        "shrink",
        f"{_COMP}.CompressorBackendMixin.forward_core_compressor",
        "around",
        ("self", "x", "forward_batch", "layer_id", "compressor"),
        "around_compress",
        "srt/layers/attention/dsv4/compressor_v2.py:227,361 the c4 KV compressor stores at reserve cells "
        "(where HiSparse translates its locs), not at pool locs",
    ),
    # The PD decode waiting queue (either mode): a step admits what its warm-start budget holds; under the disk
    # tier's cap (SGLANG_PATHP_HOST_MIRROR_GB) a queued request whose pages are on disk waits for them.
    Patch(
        "path_p",
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._get_new_prebuilt_batch",
        "around",
        "flashmemory.sglang.decode.queue_gate:around_prebuilt_batch",
        ("self", "running_batch"),
        "srt/disaggregation/decode.py:3375 the decode waiting queue -> running batch: hold back the requests "
        "past the step's warm-start budget, and one whose pages are read back from disk",
    ),
    _h(
        "credit_c4",
        f"{_CFG}.DSV4PoolConfigurator._compressed_bytes_per_full_token",
        "around",
        ("self", "ratio"),
        "around_c4_bytes_per_token",
        "srt/model_executor/pool_configurator.py:1390 the freed c4 bytes are credited to the token budget",
    ),
    # (3) CUDA graph: static buffers before capture, capture-head hook to learn the bucket size.
    _h(
        "cudagraph",
        f"{_MR}.init_cuda_graphs",
        "before",
        ("self",),
        "before_init_cuda_graphs",
        "srt/model_executor/model_runner.py:1170 static buffers before CUDA-graph capture",
    ),
    # (4) Level-1 side band: publish before a forward, launch after a decode forward.
    _h(
        "level1",
        f"{_MR}.init_cuda_graphs",
        "before",
        ("self",),
        "before_init_cuda_graphs",
        "srt/model_executor/model_runner.py:1170 the side band's static buffers before capture",
    ),
    _h(
        "level1",
        f"{_MR}.forward",
        "before",
        ("self", "forward_batch"),
        "before_forward",
        "srt/model_executor/model_runner.py:1813 publish the Level-1 result before a forward",
    ),
    _h(
        "level1",
        f"{_MR}.forward",
        "after",
        ("self", "forward_batch"),
        "after_forward",
        "srt/model_executor/model_runner.py:1813 launch Level 1 after a decode forward",
    ),
    # (5) Dump mode: per-request control from custom_params, flush when idle.
    _h(
        "dump",
        f"{_IDX}.C4IndexerBackendMixin.forward_c4_indexer",
        "around",
        C4_INDEXER,
        "around_forward_c4_indexer",
        WHY_C4,
    ),
    _h(
        "dump",
        f"{_SCHED}._add_request_to_queue",
        "before",
        ("self", "req"),
        "before_add_request",
        "srt/managers/scheduler.py:3480 per-request dump control from custom_params",
    ),
    _h(
        "dump",
        f"{_SCHED}.on_idle",
        "after",
        ("self",),
        "after_on_idle",
        "srt/managers/scheduler.py:5240 flush the dump when idle",
    ),
    # (6) The guard (`guard.py`): a request a hook failed finishes with an abort; idle releases rows, gauges say idle.
    _h(
        "path_p",
        f"{_SCHED}.process_batch_result",
        "before",
        ("self", "batch", "result"),
        "before_process_batch_result",
        "srt/managers/scheduler.py:5074 requests a hook failed finish with FINISH_ABORT",
    ),
    _h(
        "path_p",
        f"{_SCHED}.on_idle",
        "after",
        ("self",),
        "after_on_idle",
        "srt/managers/scheduler.py:5241 idle: release finished requests' rows, publish the gauges",
    ),
    # (7) The start-up refusals (`refusals.py`) in the launcher, at the end of server-argument resolution: before
    # any scheduler starts. One hook; Level 1 without Level 2 is refused the same layouts, so both features list it.
    *(
        Patch(
            feature,
            _RESOLVE_LAST,
            "step",
            "flashmemory.sglang.decode.resolution_step:refuse_at_resolution",
            ("server_args",),
            "srt/arg_groups/pipeline.py:375 the last resolution step (resolve_once, in the launcher before any "
            "scheduler or DP controller starts): refuse a layout FlashMemory cannot serve, one line, SystemExit",
        )
        for feature in ("level2", "level1")
    ),
)


def features_for(env: Any) -> tuple[str, ...]:
    """Hook features a `FlashMemoryEnv` turns on; () when every gate is off (stock sglang)."""
    f: list[str] = []
    if env.decode_swap_p or env.score_resident:
        f.append("level2")
        if not env.score_resident:
            f.append("mask")
    if env.decode_swap_p:
        f.append("path_p")
        if env.pd_c4_shrink:
            f.append("shrink")
            if env.pd_credit_c4:
                f.append("credit_c4")
    if env.index_k_offload:
        f.append("path_i")
    if env.cudagraph and "level2" in f:
        f.append("cudagraph")
    if env.level1_enabled or (env.decode_swap_p and env.miss_monitor):  # the monitor reads the side band too
        f.append("level1")
    if env.dump_mode:
        f.append("dump")
    if getattr(env, "hisparse_prefetch", False):  # rows in hisparse_prefetch.PREFETCH_PATCHES
        f.append("hisparse_prefetch")
        if not getattr(env, "cpu", False):  # the CPU layer hooks HiSparseCoordinator.destroy itself (no side stream)
            f.append("hisparse_prefetch_sync")
    return tuple(f)
