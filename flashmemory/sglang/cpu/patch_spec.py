"""Transitional: `CpuPatch(target, hook_type, impl, params, why)` builds the one spec type,
`flashmemory.sglang.patch_spec.Patch`, with feature "cpu". New tables write `Patch(...)` directly; this
factory stays only until the last table that still calls it is converted.
"""

from __future__ import annotations

from flashmemory.sglang.patch_spec import Patch


def CpuPatch(target: str, hook_type: str, impl: str, params: tuple[str, ...], why: str,  # noqa: N802
             feature: str = "cpu") -> Patch:
    """A CPU-layer `Patch` (feature "cpu" unless given), from the old positional form."""
    return Patch(feature, target, hook_type, impl, params, why)
