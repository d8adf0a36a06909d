"""`FlashMemoryCpuPlatform`: the platform class `platform.activate()` names when SGLANG_FLASHMEMORY_CPU=1.

A subclass of sglang's in-tree `CpuSRTPlatform`, so it keeps the CPU identity (`is_cpu()` paths, not
out-of-tree): sglang's CPU code paths apply unchanged; it only adds the DeepSeek-V4 server-arg defaults.
"""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuSRTPlatform

from flashmemory.env import CPU_GATE, cpu_enabled


class FlashMemoryCpuPlatform(CpuSRTPlatform):
    """sglang's CPU platform (same identity: in-tree CPU code paths apply) plus DSv4-on-CPU server defaults."""

    def apply_server_args_defaults(self, server_args) -> None:
        # The DSv4 top-k kernels are CUDA; sglang's own torch top-k is the only one that runs here.
        if getattr(server_args, "dsa_topk_backend", None) != "torch":
            server_args.dsa_topk_backend = "torch"
        if cpu_enabled() and getattr(server_args, "device", "cpu") not in (None, "cpu"):
            raise SystemExit(
                f"FlashMemory startup error: {CPU_GATE}=1 needs --device cpu (got --device {server_args.device})"
            )
