"""Every drop-in takes the same parameters (names, kinds, defaults) as the sglang function it replaces."""

from __future__ import annotations

import importlib
import inspect

import pytest

PAIRS = [
    ("sglang.kernels.ops.attention.dsv4.compress:compress_forward", "compressor:compress_forward"),
    ("sglang.kernels.ops.attention.dsv4.compress:compress_norm_rope_store", "norm_rope:compress_norm_rope_store"),
    ("sglang.kernels.ops.attention.dsv4.compress:CompressorPrefillPlan.generate", "compress_plan:generate_prefill"),
    ("sglang.kernels.ops.attention.dsv4.compress:CompressorDecodePlan.generate", "compress_plan:generate_decode"),
    ("sglang.kernels.ops.attention.dsv4.norm_rope:fused_rope_inplace", "norm_rope:fused_rope_inplace"),
    ("sglang.kernels.ops.attention.dsv4.norm_rope:fused_norm_rope_inplace", "norm_rope:fused_norm_rope_inplace"),
    ("sglang.kernels.ops.attention.dsv4.norm_rope:fused_q_norm_rope", "norm_rope:fused_q_norm_rope"),
    ("sglang.kernels.ops.attention.dsv4.norm_rope:fused_k_norm_rope_flashmla", "norm_rope:fused_k_norm_rope_flashmla"),
    ("sglang.kernels.ops.attention.dsv4.norm_rope:fused_q_indexer_rope_hadamard_quant",
     "indexer_q:fused_q_indexer_rope_hadamard_quant"),
    ("sglang.kernels.ops.attention.dsv4.attn:fused_store_cache", "stores:fused_store_cache"),
    ("sglang.kernels.ops.activation.silu_and_mul_clamp:silu_and_mul_clamp", "activation:silu_and_mul_clamp"),
    ("sglang.kernels.ops.layernorm.mhc:hc_split_sinkhorn", "mhc:hc_split_sinkhorn"),
    ("sglang.kernels.ops.layernorm.mhc:mhc_combine", "mhc:mhc_combine"),
    ("sglang.kernels.ops.layernorm.mhc_head:fused_hc_head", "mhc:fused_hc_head"),
]


def _resolve(spec: str, package: str = ""):
    mod, attr = spec.split(":")
    obj = importlib.import_module(package + mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("theirs,ours", PAIRS, ids=[p[1] for p in PAIRS])
def test_same_parameters(theirs, ours):
    pytest.importorskip("sglang")
    assert _shape(_resolve(ours, "flashmemory.sglang.cpu.")) == _shape(_resolve(theirs))
