"""Where FlashMemory hooks into sglang 0.5.23, and what each hook expects of its target.

A `HookSpec` names one target, the hook type, the leading parameter names the hook reads (by
position and name; a rename upstream must fail loudly, not bind the wrong argument), and the feature
that needs it. `resolve` and `check_signature` import sglang lazily so this table is cheap to import.
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any

_IDX = "sglang.srt.layers.attention.dsv4.indexer"
_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_ATTN = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend"
_NIXL = "sglang.srt.disaggregation.nixl.conn"
_COMP = "sglang.srt.layers.attention.dsv4.compressor_v2"
_CFG = "sglang.srt.model_executor.pool_configurator"


class TargetError(RuntimeError):
    """A hook target is missing from the installed sglang or its signature changed."""


@dataclass(frozen=True)
class HookSpec:
    feature: str                 # "level2", "mask", "path_p", "shrink", "credit_c4", "path_i", "cudagraph", "level1", "dump"
    target: str                  # dotted path for HookRegistry
    hook_type: str               # "before" | "after" | "around"
    params: tuple[str, ...]      # leading parameters the hook relies on, in order
    hook: str                    # attribute of flashmemory.sglang.hooks that implements it


TOPK = ("scores", "seq_lens", "page_tables", "out_page_indices", "page_size")

SPECS: tuple[HookSpec, ...] = (
    # (1) Level 2 in the C4 indexer (mask mode and score-resident mode), also the dump recorder.
    HookSpec("level2", f"{_IDX}.C4IndexerBackendMixin.forward_c4_indexer", "around",
             ("self", "x", "q_lora", "c4_indexer", "forward_batch"), "around_forward_c4_indexer"),
    HookSpec("mask", f"{_IDX}.topk_transform_paged", "around", TOPK, "around_topk"),
    HookSpec("mask", f"{_IDX}.topk_transform_paged_v2", "around", TOPK, "around_topk"),
    HookSpec("mask", f"{_IDX}.topk_transform_pytorch_vectorized", "around", TOPK, "around_topk"),
    # (2) Path-P / Path-I in the DSv4 memory pool.
    HookSpec("path_p", f"{_POOL}.__init__", "after",
             ("self", "max_num_reqs", "swa_size", "c4_size", "c128_size"), "after_pool_init"),
    HookSpec("path_p", f"{_POOL}.get_extra_key_buffer", "around", ("self", "layer_id"), "around_get_extra_key_buffer"),
    # The reserve is read only inside attention: the core compressor also calls get_extra_key_buffer to store.
    HookSpec("path_p", f"{_ATTN}.forward", "around", ("self", "q", "k", "v", "layer", "forward_batch"), "around_attention"),
    HookSpec("path_p", f"{_POOL}.set_extra_key_buffer", "after", ("self", "layer_id", "loc"), "after_set_extra_key"),
    HookSpec("path_p", f"{_POOL}.set_extra_key_buffer_fused", "after", ("self", "layer_id", "loc"), "after_set_extra_key"),
    HookSpec("path_p", f"{_POOL}.get_contiguous_buf_infos", "around", ("self",), "around_contiguous_buf_infos"),
    HookSpec("path_p", f"{_POOL}.set_index_k_fused", "after", ("self", "layer_id", "loc"), "after_set_index_k"),
    HookSpec("path_p", f"{_MR}.forward", "before", ("self", "forward_batch"), "before_forward"),
    HookSpec("path_p", f"{_MR}.forward", "after", ("self", "forward_batch"), "after_forward"),
    HookSpec("path_i", f"{_POOL}.get_index_k_with_scale_buffer", "around", ("self", "layer_id"), "around_get_index_k"),
    HookSpec("path_i", f"{_POOL}.set_index_k_fused", "after", ("self", "layer_id", "loc"), "after_set_index_k"),
    # Shrink mode (PD decode): no full-size device c4 KV pool, PD lands c4 KV in the host mirror (NIXL DRAM).
    HookSpec("shrink", f"{_POOL}._init_compressed_pools", "around", ("self",), "around_init_compressed_pools"),
    HookSpec("shrink", f"{_POOL}._make_kv_pool", "around", ("self",), "around_make_kv_pool"),
    HookSpec("shrink", f"{_NIXL}.NixlKVManager.__init__", "before", ("self", "args", "disaggregation_mode"),
             "before_nixl_manager_init"),
    # forward_indexer_compressor is a class-level alias of forward_unified (compressor_v2.py:360), bound at class
    # creation: patching forward_unified would not reach the callers (indexer.py:552,592; deepseek_v4.py:2148).
    HookSpec("shrink", f"{_COMP}.CompressorBackendMixin.forward_indexer_compressor", "around",
             ("self", "x", "forward_batch", "layer_id", "compressor"), "around_compress"),
    HookSpec("credit_c4", f"{_CFG}.DSV4PoolConfigurator._compressed_bytes_per_full_token", "around", ("self", "ratio"),
             "around_c4_bytes_per_token"),
    # (3) CUDA graph: static buffers before capture, capture-head hook to learn the bucket size.
    HookSpec("cudagraph", f"{_MR}.init_cuda_graphs", "before", ("self",), "before_init_cuda_graphs"),
    # (4) Level-1 side band: publish before a forward, launch after a decode forward.
    HookSpec("level1", f"{_MR}.init_cuda_graphs", "before", ("self",), "before_init_cuda_graphs"),
    HookSpec("level1", f"{_MR}.forward", "before", ("self", "forward_batch"), "before_forward"),
    HookSpec("level1", f"{_MR}.forward", "after", ("self", "forward_batch"), "after_forward"),
    # (5) Dump mode: per-request control from custom_params, flush when idle.
    HookSpec("dump", f"{_IDX}.C4IndexerBackendMixin.forward_c4_indexer", "around",
             ("self", "x", "q_lora", "c4_indexer", "forward_batch"), "around_forward_c4_indexer"),
    HookSpec("dump", f"{_SCHED}._add_request_to_queue", "before", ("self", "req"), "before_add_request"),
    HookSpec("dump", f"{_SCHED}.on_idle", "after", ("self",), "after_on_idle"),
    # (6) The guard (`guard.py`): a request a hook failed finishes with an abort; idle releases rows, gauges say idle.
    HookSpec("path_p", f"{_SCHED}.process_batch_result", "before", ("self", "batch", "result"),
             "before_process_batch_result"),
    HookSpec("path_p", f"{_SCHED}.on_idle", "after", ("self",), "after_on_idle"),
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
    return tuple(f)


def specs_for(features: tuple[str, ...]) -> list[HookSpec]:
    """Specs of the given features, one per (target, hook type) so a shared hook is registered once."""
    seen: set[tuple[str, str]] = set()
    out = []
    for s in SPECS:
        if s.feature in features and (s.target, s.hook_type) not in seen:
            seen.add((s.target, s.hook_type))
            out.append(s)
    return out


def resolve(target: str) -> tuple[Any, str, Any]:
    """(owner object, attribute name, current attribute value, unwrapped from classmethod/staticmethod)."""
    owner_path, attr = target.rsplit(".", 1)
    try:
        owner = pkgutil.resolve_name(owner_path)
    except Exception as e:  # ImportError, AttributeError, or an import-time error inside sglang
        raise TargetError(f"hook target {target}: cannot import {owner_path}: {type(e).__name__}: {e}") from None
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if raw is None and not hasattr(owner, attr):
        raise TargetError(f"hook target {target}: {owner_path} has no attribute {attr!r} (sglang changed?)")
    value = getattr(owner, attr)
    if isinstance(raw, (classmethod, staticmethod)):
        value = raw.__func__
    return owner, attr, value


def unwrap(fn: Any) -> Any:
    """Follow `__wrapped__` (HookRegistry and functools.wraps set it) to the original function."""
    seen = 0
    while hasattr(fn, "__wrapped__") and seen < 64:
        fn, seen = fn.__wrapped__, seen + 1
    return fn


def check_signature(spec: HookSpec) -> None:
    """Raise TargetError unless the target's leading parameters are exactly `spec.params`, in order."""
    _, _, fn = resolve(spec.target)
    try:
        names = list(inspect.signature(unwrap(fn)).parameters)
    except (TypeError, ValueError) as e:
        raise TargetError(f"hook target {spec.target}: no inspectable signature ({e})") from None
    want = list(spec.params)
    if names[: len(want)] != want:
        raise TargetError(f"hook target {spec.target}: expected leading parameters {want}, "
                          f"found {names[: len(want) + 2]} (sglang signature drift)")
