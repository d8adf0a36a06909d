"""Entry point `flashmemory.sglang.cpu.platform:activate` (group `sglang.srt.platforms`).

sglang resolves `current_platform` when `sglang.srt.utils.common` is imported (its line 102), which every sglang
process does before building a model: the launcher, each scheduler, the detokenizer. Discovery calls `activate()`
of every installed platform plugin (or only the one `SGLANG_PLATFORM` names). With SGLANG_FLASHMEMORY_CPU unset it
returns None and sglang picks its platform as shipped. With it set, it
- sets sglang's own CPU switches (`CPU_SWITCHES`) unless the user set them, so the spawned processes inherit them;
- stubs the CUDA-only kernel wheels (`stubs.install_stubs`) before any sglang module imports them;
- returns `FlashMemoryCpuPlatform`: sglang's in-tree `CpuSRTPlatform` plus the DSv4 server-arg defaults.
The torch fallbacks themselves are installed later, by `flashmemory.sglang.cpu.install` from the plugin.
"""

from __future__ import annotations

import logging
from typing import MutableMapping

from flashmemory.env import CPU_GATE, cpu_enabled, set_defaults

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it

# sglang's env switches that select its existing torch / non-fused paths (see the README's CPU section).
CPU_SWITCHES: dict[str, str] = {
    "SGLANG_USE_CPU_ENGINE": "1",                 # CPU platform; otherwise --device cpu imports vllm (utils/common.py:221)
    "TRITON_INTERPRET": "1",                      # integer metadata Triton kernels run interpreted (no CPU driver)
    "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL": "0",    # prefill through the sparse-decode path, not FlashMLA sparse
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",     # indexer logits: sglang's torch reference, not DeepGEMM
    "SGLANG_DSA_FUSE_TOPK": "false",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",       # mHC: torch paths instead of TileLang
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_FUSE_MHC_POST_PRE": "0",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
    "SGLANG_OPT_USE_FUSED_HASH_TOPK": "0",        # hash-MoE top-k in torch
    "SGLANG_OPT_FP8_WO_A_GEMM": "0",              # wo_a as a plain bf16 GEMM
    "SGLANG_DSV41_FUSED_WO_A": "0",
    "SGLANG_OPT_DSV4_NONPAGED_INDEXER": "0",
    "SGLANG_OPT_USE_JIT_INDEXER_METADATA": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
    "SGLANG_OPT_USE_ONLINE_COMPRESS": "0",        # the offline c4/c128 compressor (the torch one covers it)
    "SGLANG_DSV4_KV_LAYOUT": "v4",                # the 584-B V4 layout the torch stores write
    # NIXL's UCX would load its InfiniBand modules, whose bundled libnl-route and the system's (via libibverbs)
    # both register at load: the second unregister segfaults at process exit (rtnl_tc_unregister in _dl_fini).
    # PD on CPU moves bytes over shared memory / TCP, so the IB modules are not needed.
    "UCX_MODULES": "^ib*",
}
PLATFORM_CLASS = "flashmemory.sglang.cpu.cpu_platform.FlashMemoryCpuPlatform"


def apply_switches(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each switch the user did not set (`flashmemory.env.set_defaults`, default the process environment);
    returns the ones that differ from ours (the user's choice wins)."""
    return set_defaults(CPU_SWITCHES, environ)


def activate() -> str | None:
    """Platform-plugin entry: None when SGLANG_FLASHMEMORY_CPU is off, else the platform class path."""
    try:
        on = cpu_enabled()
    except ValueError as e:            # a malformed value: refuse loudly rather than fall back to CUDA
        raise SystemExit(f"FlashMemory startup error: {e}") from None
    if not on:
        return None
    differ = apply_switches()
    if differ:
        logger.warning("FlashMemory CPU: user-set switches kept: %s", differ)
    from flashmemory.sglang.cpu.stubs import install_stubs
    install_stubs()
    return PLATFORM_CLASS
