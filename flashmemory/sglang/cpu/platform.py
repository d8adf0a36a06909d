"""Entry point `flashmemory.sglang.cpu.platform:activate` (group `sglang.srt.platforms`).

sglang resolves `current_platform` when `sglang.srt.utils.common` is imported (its line 102), which every sglang
process does before building a model: the launcher, each scheduler, the detokenizer. Discovery calls `activate()`
of every installed platform plugin (or only the one `SGLANG_PLATFORM` names). With SGLANG_FLASHMEMORY_CPU unset it
returns None and sglang picks its platform as shipped. With it set, it
- sets sglang's own CPU switches (the `env` rows of `PLATFORM_PATCHES`) unless the user set them, so the spawned
  processes inherit them;
- stubs the CUDA-only kernel wheels (its `import_stub` rows, `stubs.install_stubs`) before any sglang module
  imports them;
- returns `FlashMemoryCpuPlatform`: sglang's in-tree `CpuSRTPlatform` plus the DSv4 server-arg defaults.
Both go through the one apply loop (`flashmemory.sglang.plumbing.patching`); the torch fallbacks are applied later, by
the plugin's `register()` (or `cpu.install.register`).
"""

from __future__ import annotations

import logging

from flashmemory.env import cpu_enabled
from flashmemory.sglang.plumbing.patch_spec import Patch

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it

_EV = "srt/environ.py: envs."


def _env(name: str, value: str, why: str) -> Patch:
    return Patch("cpu", name, "env", value, (), why)


def _stub(package: str, why: str) -> Patch:
    return Patch("cpu", package, "import_stub", "flashmemory.sglang.cpu.stubs:install_stubs", (), why)


# sglang's env switches that select its existing torch / non-fused paths (see the README's CPU section), and the
# CUDA-only wheels stubbed when they cannot import. Applied by `activate`, in this order, before sglang reads them.
PLATFORM_PATCHES: tuple[Patch, ...] = (
    _env(
        "SGLANG_USE_CPU_ENGINE",
        "1",
        "platforms/__init__.py:50 the CPU platform; otherwise --device cpu imports vllm (utils/common.py:221)",
    ),
    _env(
        "TRITON_INTERPRET",
        "1",
        "triton (not sglang): the integer-metadata Triton kernels run interpreted (no CPU driver)",
    ),
    _env(
        "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL",
        "0",
        "layers/attention/deepseek_v4_backend.py:2931 prefill through the sparse-decode path, not FlashMLA sparse",
    ),
    _env(
        "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH",
        "1",
        "layers/attention/dsv4/metadata.py:206, dsa/utils.py:355 "
        "indexer logits: sglang's torch reference, not DeepGEMM",
    ),
    _env("SGLANG_DSA_FUSE_TOPK", "false", "layers/attention/dsa/dsa_topk_backend.py:109 unfused top-k"),
    _env("SGLANG_OPT_USE_TILELANG_MHC_PRE", "0", "models/deepseek_v4.py:3421 mHC pre: torch, not TileLang"),
    _env("SGLANG_OPT_USE_TILELANG_MHC_POST", "0", "models/deepseek_v4_mhc.py:576 mHC post: torch, not TileLang"),
    _env("SGLANG_OPT_FUSE_MHC_POST_PRE", "0", "models/deepseek_v4.py:301 mHC post and pre unfused"),
    _env("SGLANG_OPT_DEEPGEMM_HC_PRENORM", "0", "models/deepseek_v4.py:3287 hc pre-norm without DeepGEMM"),
    _env("SGLANG_OPT_USE_FUSED_HASH_TOPK", "0", "layers/moe/hash_topk.py:248 hash-MoE top-k in torch"),
    _env("SGLANG_OPT_FP8_WO_A_GEMM", "0", "models/deepseek_v4.py:276 wo_a as a plain bf16 GEMM"),
    _env("SGLANG_DSV41_FUSED_WO_A", "0", "models/deepseek_v4.py:1535 wo_a unfused"),
    _env("SGLANG_OPT_DSV4_NONPAGED_INDEXER", "0", "layers/attention/dsv4/indexer.py:607 the paged indexer"),
    _env(
        "SGLANG_OPT_USE_JIT_INDEXER_METADATA",
        "0",
        "layers/attention/dsv4/metadata.py:216 indexer metadata without the JIT kernel",
    ),
    _env("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0", "managers/tokenizer_manager.py:3396 no CUDA core dump"),
    _env(
        "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK",
        "1",
        "entrypoints/engine.py:1948, utils/common.py:2418 the stubbed sgl_kernel has no version",
    ),
    _env(
        "SGLANG_OPT_USE_ONLINE_COMPRESS",
        "0",
        "model_executor/pool_configurator.py:1261 the offline c4/c128 compressor (the torch one covers it)",
    ),
    _env(
        "SGLANG_DSV4_KV_LAYOUT",
        "v4",
        "mem_cache/deepseek_v4_memory_pool.py:202 the 584-B V4 layout the torch stores write",
    ),
    # NIXL's UCX would load its InfiniBand modules, whose bundled libnl-route and the system's (via libibverbs)
    # both register at load: the second unregister segfaults at process exit (rtnl_tc_unregister in _dl_fini).
    # PD on CPU moves bytes over shared memory / TCP, so the IB modules are not needed.
    _env(
        "UCX_MODULES",
        "^ib*",
        "UCX (not sglang, read by NIXL's UCX backend): no InfiniBand modules (their "
        "libnl-route segfaults at process exit); PD on CPU moves bytes over shared memory / TCP",
    ),
    _stub(
        "sgl_kernel",
        "~100 sglang modules import it at module level; it raises without libcuda.so.1 "
        "(e.g. srt/layers/activation.py, srt/utils/common.py)",
    ),
    _stub(
        "flash_mla",
        "imported at module level by the DSv4 attention backends; raises without libcuda.so.1 "
        "(kernels/ops/attention/flash_mla*.py)",
    ),
)
CPU_SWITCHES: dict[str, str] = {p.target: p.impl for p in PLATFORM_PATCHES if p.kind == "env"}
PLATFORM_CLASS = "flashmemory.sglang.cpu.cpu_platform.FlashMemoryCpuPlatform"


def activate() -> str | None:
    """Platform-plugin entry: None when SGLANG_FLASHMEMORY_CPU is off, else the platform class path (after the
    `env` and `import_stub` rows of `PLATFORM_PATCHES` are applied through `patching.apply`)."""
    try:
        on = cpu_enabled()
    except ValueError as e:  # a malformed value: refuse loudly rather than fall back to CUDA
        raise SystemExit(f"FlashMemory startup error: {e}") from None
    if not on:
        return None
    from flashmemory.sglang.plumbing.patching import PLATFORM_KINDS, apply, select

    apply(select(("cpu",), PLATFORM_KINDS, PLATFORM_PATCHES))
    return PLATFORM_CLASS
