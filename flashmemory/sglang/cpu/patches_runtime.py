"""CPU seams outside the kernels: RoPE construction, the fp8 KV-cache check, and FlashMLA decode.

- `get_rope_wrapper` (rotary_embedding/factory.py:517): on CPU it calls `get_rope_cpu`, which asserts a
  `deepseek_yarn` scaling (factory.py:478); DSv4's SWA-only layers have none. Those get sglang's generic
  `get_rope` (its CPU-safe torch RoPE); scaled layers keep `get_rope_cpu`.
- `KVCacheConfigurator.configure` (kv_cache_configurator.py:459-467): refuses an fp8 KV cache on CPU
  without Intel AMX. DSv4 stores its fp8 KV as raw bytes written by the torch stores, so for the DSv4 pool
  the check is skipped: the module's `current_platform` is a delegating view (an `attr` row, installed when the
  CPU layer registers) whose `is_cpu()` is False only on the thread running a DSv4 fp8 `configure`, and true
  everywhere else, so
  a configure on one thread changes nothing another thread sees (the only `is_cpu()` reads in that module
  are that check and the MHA fp8 quant method at :453).
- `DeepseekV4AttnBackend` decode (deepseek_v4_backend.py:4384): calls `self._flash_mla_with_kvcache`, which
  `__init__` sets only on CUDA (:1262). After `__init__` it is set to the torch sparse decode
  (`sparse_attention.sparse_decode_fwd`: the math of sglang's torch path `flash_mla_sm120.py:136
  _sm120_sparse_decode_fwd`, tested equal to it, with per-page dequantization), and
  `_create_flashmla_metadata` (:210, the FlashMLA tile scheduler) returns None, which that path never reads.
- `DeepseekV4AttnBackend._move_to_device` (:1381): pins host memory, impossible without a CUDA driver.
- `_set_envs_and_config` (entrypoints/engine.py:1995) sets multiprocessing's start method to "spawn" (CUDA
  cannot be forked), so the scheduler and the detokenizer each import sglang again: about 25 CPU-s per process
  on this 2-core box, 89 CPU-s for a server start against 38 CPU-s when both are forked (two separate starts
  of one stock server, `ps` TIME of its three processes: a sign, not a benchmark). On CPU there is no CUDA
  context to fork, so after that function the start method is "fork" when the launcher has one OS thread
  (measured: it has, at that point); with more, spawn stays (a fork copies no other thread, and a lock another
  thread holds would stay held in the child; an OpenMP pool that torch already started, which a forked child
  could not use, shows up as such threads too).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from flashmemory.sglang.plumbing.patch_spec import Patch

logger = logging.getLogger(__name__)
_BK = "sglang.srt.layers.attention.deepseek_v4_backend"
_RT = "flashmemory.sglang.cpu.patches_runtime"


def rope_wrapper(
    original: Callable,
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: int,
    is_neox_style: bool = True,
    rope_scaling: Any = None,
    dtype: Any = None,
    partial_rotary_factor: float = 1.0,
    device: Any = None,
) -> Any:
    if device == "cpu" and rope_scaling is None:
        from sglang.srt.layers.rotary_embedding.factory import get_rope

        return get_rope(
            head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype, partial_rotary_factor
        )
    return original(
        head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype, partial_rotary_factor, device
    )


class Dsv4Fp8PlatformView:
    """Delegates to sglang's platform, except that `is_cpu()` is False on a thread inside `inside()` (a DSv4
    fp8 `configure`; see the module docstring). The depth is per thread, so other threads see the truth."""

    def __init__(self, platform: Any):
        self.platform = platform
        self.local = threading.local()

    def is_cpu(self) -> bool:
        return False if getattr(self.local, "depth", 0) else self.platform.is_cpu()

    @contextmanager
    def inside(self) -> Iterator[None]:
        self.local.depth = getattr(self.local, "depth", 0) + 1
        try:
            yield
        finally:
            self.local.depth -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.platform, name)


def dsv4_fp8_platform_view(platform: Any) -> Dsv4Fp8PlatformView:
    """Builder of the `attr` row on kv_cache_configurator's `current_platform`: sglang's platform behind a
    `Dsv4Fp8PlatformView` (an already wrapped one is kept, so a second registration does not stack views)."""
    return platform if isinstance(platform, Dsv4Fp8PlatformView) else Dsv4Fp8PlatformView(platform)


def configure_dsv4_fp8(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """The DSv4 fp8 `configure` runs inside the module's platform view (its `attr` row), where `is_cpu()` is
    False on this thread; any other model, dtype, or a process without the view runs sglang's check as shipped."""
    import sglang.srt.mem_cache.kv_cache_configurator as kcc
    from sglang.srt.configs.model_config import is_deepseek_v4

    view = kcc.current_platform
    if not (
        isinstance(view, Dsv4Fp8PlatformView)
        and is_deepseek_v4(self.model_config.hf_config)
        and self.kv_cache_dtype == torch.float8_e4m3fn
    ):
        return original(self, *args, **kwargs)
    with view.inside():
        return original(self, *args, **kwargs)


def no_flashmla_metadata() -> None:
    return None


def sparse_decode_torch(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    indices: torch.Tensor,
    topk_length: Any = None,
    attn_sink: Any = None,
    extra_k_cache: Any = None,
    extra_indices_in_kvcache: Any = None,
    extra_topk_length: Any = None,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_mla_with_kvcache` keyword call (block_table / cache_seqlens / tile_scheduler_metadata /
    is_fp8_kvcache are FlashMLA scheduling details) -> torch sparse decode: (out, lse). `sparse_decode_fwd`
    computes what sglang's `_sm120_sparse_decode_fwd` does (tested equal), dequantizing per page."""
    from flashmemory.sglang.cpu.ops.sparse_attention import sparse_decode_fwd

    return sparse_decode_fwd(
        q,
        k_cache,
        indices,
        topk_length,
        attn_sink,
        head_dim_v,
        softmax_scale,
        extra_k_cache,
        extra_indices_in_kvcache,
        extra_topk_length,
    )


def after_backend_init(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    from flashmemory.sglang.cpu.patches_tp import cpu_pad_fill_value

    cpu_pad_fill_value(result, self)
    if getattr(self, "_flash_mla_with_kvcache", None) is None:
        self._flash_mla_with_kvcache = sparse_decode_torch
        self._swa_interleaved = self.token_to_kv_pool.get_swa_key_layout().is_interleaved
        self._flashmla_split_kv_min_topk = 1 << 30


def move_to_device(self: Any, x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=self.device)


def os_threads() -> int:
    """OS threads of this process (Python's `threading` does not see threads that C libraries start)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def fork_children(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of `_set_envs_and_config`: sglang's subprocesses start by fork on CPU (module docstring)."""
    threads = os_threads()
    if threads == 1:
        multiprocessing.set_start_method("fork", force=True)
        logger.info(
            "FlashMemory CPU layer: sglang's scheduler and detokenizer start by fork (they share the "
            "launcher's imports)"
        )
    else:
        logger.warning(
            "FlashMemory CPU layer: the launcher runs %d threads, so sglang's subprocesses start by "
            "spawn (each imports sglang again)",
            threads,
        )


RUNTIME_PATCHES: tuple[Patch, ...] = (
    Patch(
        "cpu",
        "sglang.srt.layers.rotary_embedding.factory.get_rope_wrapper",
        "around",
        f"{_RT}:rope_wrapper",
        ("head_size", "rotary_dim", "max_position", "base"),
        "rotary_embedding/factory.py:478 get_rope_cpu asserts deepseek_yarn; unscaled layers -> get_rope",
    ),
    Patch(
        "cpu",
        "sglang.srt.mem_cache.kv_cache_configurator.current_platform",
        "attr",
        f"{_RT}:dsv4_fp8_platform_view",
        (),
        "kv_cache_configurator.py:100,453,459 this module's platform, as a "
        "view whose is_cpu() is False only inside a DSv4 fp8 configure",
    ),
    Patch(
        "cpu",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure",
        "around",
        f"{_RT}:configure_dsv4_fp8",
        ("self",),
        "kv_cache_configurator.py:459-467 CPU fp8 KV needs AMX; skipped for the DSv4 byte pool",
    ),
    Patch(
        "cpu",
        f"{_BK}._create_flashmla_metadata",
        "replace",
        f"{_RT}:no_flashmla_metadata",
        (),
        "deepseek_v4_backend.py:210 FlashMLA tile-scheduler metadata (CUDA); the torch decode needs none",
    ),
    Patch(
        "cpu",
        f"{_BK}.DeepseekV4AttnBackend.__init__",
        "after",
        f"{_RT}:after_backend_init",
        ("self",),
        "deepseek_v4_backend.py:1262,4384 FlashMLA sparse decode -> flash_mla_sm120.py:136 torch path",
    ),
    Patch(
        "cpu",
        f"{_BK}.DeepseekV4AttnBackend._move_to_device",
        "replace",
        f"{_RT}:move_to_device",
        ("self", "x"),
        "deepseek_v4_backend.py:1382 pin_memory=True without a CUDA driver",
    ),
    Patch(
        "cpu",
        "sglang.srt.entrypoints.engine._set_envs_and_config",
        "after",
        f"{_RT}:fork_children",
        ("server_args",),
        "entrypoints/engine.py:1995 spawn (each child re-imports sglang) -> fork on CPU when the "
        "launcher is single-threaded",
    ),
)
