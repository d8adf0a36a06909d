"""Pinning is dropped only where it cannot work."""

from __future__ import annotations

import torch

from flashmemory.sglang.cpu.pinning import drop_pin_memory, pin_if_possible, torch_without_pinning


def test_factory_drops_pin_memory_only_when_unavailable():
    seen = []

    def factory(*args, **kwargs):
        seen.append(kwargs.get("pin_memory"))
        return args

    drop_pin_memory(factory, available=lambda: False)(3, pin_memory=True)
    drop_pin_memory(factory, available=lambda: True)(3, pin_memory=True)
    drop_pin_memory(factory, available=lambda: False)(3)
    assert seen == [False, True, None]


def test_torch_proxy_on_this_machine():
    t = torch_without_pinning(available=lambda: False)
    a = t.empty((2, 16), dtype=t.uint8, pin_memory=True)
    b = t.tensor([1, 2, 3], dtype=t.int32, pin_memory=True)
    assert a.shape == (2, 16) and b.tolist() == [1, 2, 3] and not b.is_pinned()
    assert t.float8_e4m3fn is torch.float8_e4m3fn and t.view_as_real is torch.view_as_real
    if not torch.cuda.is_available():
        x = torch.ones(2)
        assert pin_if_possible(x) is x
