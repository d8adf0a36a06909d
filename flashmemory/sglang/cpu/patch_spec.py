"""`CpuPatch`: one sglang function the CPU layer replaces or wraps, and why (the sglang file:line it covers).

The tables live in `patches_kernels` (CUDA-only kernels -> the pure-torch drop-ins of this package) and
`patches_runtime` (CPU seams outside the kernels); `install` registers them through sglang's HookRegistry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuPatch:
    target: str                 # dotted path HookRegistry patches (function, method or staticmethod)
    hook_type: str              # "replace" | "around" | "after"
    impl: str                   # dotted path of our function ("module:attr" or "module.attr")
    params: tuple[str, ...]     # leading parameter names the impl relies on (checked against the target)
    why: str                    # sglang file:line the patch covers, and what it does instead
