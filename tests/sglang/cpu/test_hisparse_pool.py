"""The HiSparse host pool on CPU (flashmemory/sglang/cpu/hisparse_pool.py): with the gate on, byte-exact token and
page-row copies on sglang's real `DeepSeekV4PagedHostPool`, a plain unpinned allocation, and the free-RAM budget
without the GPU host's reserve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from flashmemory.sglang.cpu import hisparse_pool as hpool
from flashmemory.sglang.cpu import patches_hisparse as hp
from flashmemory.sglang.cpu.ops import hisparse as hs
from tests.sglang.cpu.test_hisparse_patches import _pool, _ram_check_off, _token, gate  # noqa: F401 (fixtures)


def test_backup_tokens_copies_every_layer_byte_exact(gate):
    pool = _pool()
    before = [b.clone() for b in pool.kv_buffer]
    dev_locs, host_locs = torch.tensor([5, 130, 64]), torch.tensor([200, 3, 77])
    hpool.backup_tokens(None, pool, host_locs, dev_locs)
    for layer in range(2):
        for dl, hl in zip(dev_locs.tolist(), host_locs.tolist()):
            assert _token(pool.kv_buffer[layer], hl) == _token(pool.device_buffers[layer], dl)
        changed = (pool.kv_buffer[layer] != before[layer]).view(-1).nonzero().numel()
        assert changed <= 3 * hs.ITEM_BYTES  # nothing outside the three tokens moved


def test_load_layer_token_and_page_paths(gate):
    pool = _pool()
    hpool.load_layer(None, pool, None, torch.tensor([9, 250]), torch.tensor([1, 190]), 1, "kernel")
    assert _token(pool.device_buffers[1], 1) == _token(pool.kv_buffer[1], 9)
    assert _token(pool.device_buffers[1], 190) == _token(pool.kv_buffer[1], 250)
    assert _token(pool.device_buffers[0], 1) != _token(pool.kv_buffer[0], 9)  # the other layer is untouched
    # page-aligned lists (64 tokens = host page 3 -> device page 2): whole page rows, the padding included
    hpool.load_layer(None, pool, None, torch.arange(192, 256), torch.arange(128, 192), 0, "kernel")
    assert torch.equal(pool.device_buffers[0][2], pool.kv_buffer[0][3])


def test_backup_all_layers_page_path(gate):
    pool = _pool()
    hpool.backup_all_layers(None, pool, None, torch.arange(0, 64), torch.arange(64, 128), "kernel")
    for layer in range(2):
        assert torch.equal(pool.kv_buffer[layer][0], pool.device_buffers[layer][1])


def test_alloc_host_is_plain_and_unpinned(gate):
    calls = []
    alloc = SimpleNamespace(allocate=lambda dims, dtype, device: calls.append(dims) or torch.zeros(dims, dtype=dtype))
    t = hpool.alloc_host(None, (2, 5), torch.uint8, "cpu", True, alloc)
    assert calls == [(2, 5)] and t.shape == (2, 5) and not t.is_pinned()


def test_host_budget_drops_the_gpu_reserve_only_with_the_gate(monkeypatch):
    from sglang.srt.mem_cache.pool_host import base

    assert hpool.host_budget(lambda r, auto_size: -5, 0) == -5
    monkeypatch.setattr(hp, "hisparse_on_cpu", lambda: True)
    assert hpool.host_budget(lambda r, auto_size: -5, 0) == base.HICACHE_HOST_MEMORY_RESERVE_BYTES - 5
    token = base._host_memory_budget.set(7)  # inside sglang's booking scope: its snapshot stands
    try:
        assert hpool.host_budget(lambda r, auto_size: 7, 0) == 7
    finally:
        base._host_memory_budget.reset(token)
