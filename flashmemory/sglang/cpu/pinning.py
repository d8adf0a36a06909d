"""Pinned host memory as a no-op where pinning is impossible (no CUDA driver), for sglang's DSv4 path.

sglang allocates staging tensors with `pin_memory=True` (`kernels/ops/attention/dsv4/compress.py:272,334,373`,
`srt/layers/attention/deepseek_v4_backend.py:1382`, `srt/layers/attention/dsa/kpool_plan.py:316,348`); without a
CUDA driver torch raises "Found no NVIDIA driver". Pinning only speeds up host->device copies, so on CPU the
flag can be dropped with no change in results. The patch layer can either rebind a module's `torch` global to
`torch_without_pinning()` (only the tensor factories change) or wrap single callables with `drop_pin_memory`.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch

# Factories that take a pin_memory keyword.
PIN_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "empty_strided", "arange", "rand", "randn",
                 "empty_like", "zeros_like", "ones_like", "full_like")


def pinning_available() -> bool:
    """True when torch can pin host memory (a CUDA device is visible)."""
    return torch.cuda.is_available()


def drop_pin_memory(factory: Callable[..., Any], available: Optional[Callable[[], bool]] = None) -> Callable[..., Any]:
    """Wrap a tensor factory so `pin_memory=True` is ignored when pinning is not available (checked per call)."""
    can_pin = available or pinning_available

    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pin_memory") and not can_pin():
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    return call


def torch_without_pinning(available: Optional[Callable[[], bool]] = None) -> types.ModuleType:
    """A stand-in for the `torch` module: every attribute is torch's, except the factories in PIN_FACTORIES,
    which ignore pin_memory=True when pinning is not available. Tensor.pin_memory() is not affected."""
    proxy = types.ModuleType("torch_without_pinning")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[attr-defined]
    for name in PIN_FACTORIES:
        setattr(proxy, name, drop_pin_memory(getattr(torch, name), available))
    return proxy


def pin_if_possible(t: torch.Tensor) -> torch.Tensor:
    """`t.pin_memory()` where pinning works, else t itself (for call sites that pin an existing tensor)."""
    return t.pin_memory() if pinning_available() else t
