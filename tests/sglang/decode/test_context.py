"""The per-forward context (`context.ForwardContext`) against the process object (`runtime.Runtime`): each forward
gets a fresh one from `Runtime.before_forward`, so nothing a hook left for its own forward reaches the next one,
except the latest indexer call's mode; what lives as long as the process stays on the process object."""

from __future__ import annotations

import types

import torch

from flashmemory.sglang.decode.context import ForwardContext, HiSparseState
from flashmemory.sglang.decode.runtime import Runtime


def _batch(decode: bool) -> types.SimpleNamespace:
    mode = types.SimpleNamespace(is_decode=lambda: decode, is_idle=lambda: False)
    return types.SimpleNamespace(forward_mode=mode, rids=[])


def test_each_forward_gets_a_fresh_context_carrying_only_the_indexer_mode():
    rt = Runtime()
    first = rt.fwd
    first.keep_alive.append(torch.zeros(2, dtype=torch.int64))
    first.view_cache = (object(), 3, object())
    first.block_view_cache = (object(), 3, object())
    first.attn_layer, first.mask_resident, first.decode_active = 2, torch.ones(1, 4, dtype=torch.bool), True
    rt.before_forward(_batch(decode=False))
    second = rt.fwd
    assert second is not first and first.keep_alive and first.view_cache is not None  # the old one is untouched
    assert second.keep_alive == [] and second.view_cache is None and second.block_view_cache is None
    assert second.attn_layer is None and second.mask_resident is None
    assert second.decode_active is True  # index-K reads before this forward's first indexer call
    second.decode_active = False
    rt.before_forward(_batch(decode=True))
    assert rt.fwd is not second and rt.fwd.decode_active is False


def test_process_state_outlives_forwards():
    rt = Runtime()
    rt.count("x")
    hs = rt.hisparse
    hs.newest_pending[1] = (12, {7})
    for decode in (True, False, True):
        rt.before_forward(_batch(decode))
    assert rt.hisparse is hs and hs.newest_pending == {1: (12, {7})} and rt.counters == {"x": 1}
    assert isinstance(ForwardContext().next(), ForwardContext) and HiSparseState().trace_path is None
