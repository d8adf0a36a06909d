"""Install the CPU layer's patches in this process (called by `flashmemory.sglang.plugin.register`).

Each `CpuPatch` is checked (target exists, leading parameters as expected), registered with sglang's
HookRegistry, applied, and then verified: HookRegistry only logs a patch that fails to apply and
`load_plugins` swallows exceptions, so a missing patch raises `CpuLayerError` (a SystemExit) here.
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
from typing import Any, Callable

from flashmemory.sglang.cpu.patch_spec import CpuPatch

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it
_INSTALLED: list[str] | None = None


class CpuLayerError(SystemExit):
    """The CPU layer cannot be installed; the message says which patch and why."""

    def __init__(self, msg: str):
        super().__init__(f"FlashMemory CPU startup error: {msg}")


def all_patches() -> tuple[CpuPatch, ...]:
    from flashmemory.sglang.cpu.patches_kernels import KERNEL_PATCHES
    from flashmemory.sglang.cpu.patches_runtime import RUNTIME_PATCHES
    return KERNEL_PATCHES + RUNTIME_PATCHES


def _impl(p: CpuPatch) -> Callable:
    try:
        return pkgutil.resolve_name(p.impl)
    except Exception as e:
        raise CpuLayerError(f"{p.target}: cannot load its CPU version {p.impl} ({type(e).__name__}: {e})") from None


def _check(p: CpuPatch) -> Any:
    from flashmemory.sglang.targets import TargetError, resolve, unwrap
    try:
        _, _, orig = resolve(p.target)
    except TargetError as e:
        raise CpuLayerError(str(e)) from None
    if p.params:
        names = list(inspect.signature(unwrap(orig)).parameters)
        if names[: len(p.params)] != list(p.params):
            raise CpuLayerError(f"{p.target}: expected leading parameters {list(p.params)}, found "
                                f"{names[: len(p.params) + 2]} (sglang signature drift)")
    return orig


def install(patches: tuple[CpuPatch, ...] | None = None) -> list[str]:
    """Register, apply and verify the CPU patches once per process; returns the patched targets."""
    global _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from flashmemory.sglang.targets import resolve, unwrap

    patches = all_patches() if patches is None else patches
    originals = {p.target: _check(p) for p in patches}
    for p in patches:
        HookRegistry.register(p.target, _impl(p), HookType(p.hook_type))
    HookRegistry.apply_hooks()
    bad = []
    for p in patches:
        now = resolve(p.target)[2]
        if now is originals[p.target] or unwrap(now) is not unwrap(originals[p.target]):
            bad.append(p.target)
    if bad:
        raise CpuLayerError("patches did not apply (see 'Failed to apply hooks' above): " + ", ".join(bad))
    _INSTALLED = sorted(p.target for p in patches)
    logger.info("FlashMemory CPU: %d sglang functions patched for CPU", len(_INSTALLED))
    return _INSTALLED


def register() -> None:
    """Entry point `flashmemory_cpu` (group `sglang.srt.plugins`): install the CPU layer if its gate is on.

    Separate from the FlashMemory plugin so `SGLANG_PLUGINS=flashmemory_cpu` runs stock sglang (no FlashMemory
    hook registered at all) on CPU; the FlashMemory plugin installs the layer too (idempotent)."""
    from flashmemory.env import EnvError, cpu_enabled
    try:
        on = cpu_enabled()
    except EnvError as e:
        raise CpuLayerError(str(e)) from None
    if on:
        install()
