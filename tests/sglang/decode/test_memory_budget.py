"""The start-up device check against sglang's runtime headroom (`memory_budget`), with fake memory numbers: what
sglang leaves outside --mem-fraction-static, less its own activations and CUDA graphs, must hold the adapter's
static tensors, the retriever, the Level-1 worker's transients and a recall's staging; refused in one line."""

from __future__ import annotations

import types

import pytest
import torch

from flashmemory.sglang.decode import adapter_factory, geometry, memory_budget
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.geometry import PoolGeometryError
from flashmemory.sglang.decode.memory_budget import DeviceNeed, check_device_budget, runtime_need_bytes
from tests.sglang.decode.test_copy_adapter import env, fake_pool

pytestmark = pytest.mark.sglang
GIB, MIB = 2**30, 2**20


def _sa(**kw):
    base = dict(mem_fraction_static=0.5, max_running_requests=4, cuda_graph_max_bs_decode=4, tp_size=1)
    return types.SimpleNamespace(**{**base, **kw})


def test_runtime_need_is_sglangs_formula_without_its_floor():
    # 512 + 1.5 x max(256, 2048) + 1/8 GiB + 2 x 256 graph batches = 4,224 MiB
    assert runtime_need_bytes(_sa(max_running_requests=256, cuda_graph_max_bs_decode=256)) == 4224 * MIB
    assert runtime_need_bytes(_sa(disable_cuda_graph=True, tp_size=8)) == (512 + 3072 + 1024) * MIB


def test_a_need_past_the_headroom_is_refused_naming_the_settings():
    sa = _sa(max_running_requests=256, cuda_graph_max_bs_decode=256)
    need = DeviceNeed(static=5 * GIB, target_copy=3 * GIB, retriever=GIB // 2, worker_peak=GIB // 4, recall_staging=GIB)
    total, frac = 140 * GIB, 0.93  # headroom 9.8 GiB, 4.1 of it sglang's own: 5.7 GiB left, 6.75 needed
    free = int(total * (1 - frac))
    assert need.total <= 0.9 * free  # what the check allowed before: 90% of the bytes free
    with pytest.raises(PoolGeometryError) as e:
        check_device_budget(need, total, frac, runtime_need_bytes(sa), free)
    msg = str(e.value)
    assert "\n" not in msg and "--mem-fraction-static 0.93" in msg and "SGLANG_PATHP_RESERVE_PAGES" in msg
    assert "target index copy 3.00" in msg and "retriever 0.50" in msg and "recall staging 1.00" in msg
    check_device_budget(need, total, 0.85, runtime_need_bytes(sa), int(total * 0.15))  # a lower fraction fits
    # shrink mode: the c4 pool the reserve replaced was never allocated, so it counts as room
    check_device_budget(DeviceNeed(**{**need.__dict__, "saved": 2 * GIB}), total, frac, runtime_need_bytes(sa), None)


def test_the_items_are_counted_from_the_core_config():
    adapter = build(fake_pool(), env())
    try:
        core = adapter.core
        lay = core.layout
        peak = memory_budget.worker_peak_bytes(core, monitor=False)
        assert peak == 2 * len(lay.target_layers) * core.engine.max_chunks * lay.index_head_dim * 4
        assert memory_budget.worker_peak_bytes(core, monitor=True) > peak
        stage = memory_budget.recall_staging_bytes(core)
        page = lay.n_layers * lay.kv_page_bytes + len(lay.offload_index_layers) * lay.index_page_bytes
        assert stage % page == 0 and 0 < stage // page <= core.engine.recall_blocks
        assert memory_budget.module_bytes(torch.nn.Linear(4, 2)) == (8 + 2) * 4
    finally:
        adapter.close()


def test_build_refuses_before_allocating_when_sglangs_headroom_is_spent(monkeypatch):
    """Only a few MiB are free beyond sglang's own runtime need: the adapter does not fit, though its static
    tensors are far below 90% of the bytes free (the old check passed)."""
    sa = _sa()
    free = runtime_need_bytes(sa) + MIB
    monkeypatch.setattr(memory_budget, "device_memory", lambda dev: (free, 64 * GIB))
    monkeypatch.setattr(geometry, "device_free_bytes", lambda dev: free)
    built = []
    monkeypatch.setattr(adapter_factory, "CopyAdapter", lambda *a, **k: built.append(a))
    with pytest.raises(PoolGeometryError, match="outside --mem-fraction-static 0.5"):
        build(fake_pool(), env(), sa, shrink=False)
    assert built == []  # refused before the adapter allocated anything
