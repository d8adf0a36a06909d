"""Entry point `flashmemory_cpu` (group `sglang.srt.plugins`): the CPU layer's code patches in this process.

The rows of feature "cpu" (kernel drop-ins, runtime seams, HiSparse on CPU) go through the one apply-and-verify
loop, `flashmemory.sglang.plumbing.patching.apply`; a patch that fails is a SystemExit "FlashMemory startup error: ...".
"""

from __future__ import annotations

from flashmemory.sglang.plumbing.patch_spec import CODE_KINDS


def install(geometry=None) -> list[str]:
    """Apply (once per process) and verify the CPU layer's code patches, with the tiny-model rows `geometry` (a
    `flashmemory.env.CpuTinyGeometry`; None: none) turns on; returns the patched targets."""
    from flashmemory.sglang.plumbing.patching import apply, select, tiny_features

    features = ("cpu",) + (tiny_features(geometry) if geometry is not None else ())
    return apply(select(features, CODE_KINDS), context="; the CPU layer (SGLANG_FLASHMEMORY_CPU=1) needs it")


def register() -> None:
    """Install the CPU layer if its gate is on.

    Separate from the FlashMemory plugin so `SGLANG_PLUGINS=flashmemory_cpu` runs stock sglang (no FlashMemory
    hook registered at all) on CPU; the FlashMemory plugin applies these rows too (once per process)."""
    from flashmemory.env import EnvError, cpu_enabled, cpu_tiny_geometry
    from flashmemory.sglang.plumbing.patching import StartupError

    try:
        on = cpu_enabled()
        geometry = cpu_tiny_geometry()
    except EnvError as e:
        raise StartupError(str(e)) from None
    if on:
        install(geometry)
