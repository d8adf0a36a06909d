"""CUDA-only kernels on sglang's DSv4 prefill/decode path -> the pure-torch drop-ins of `cpu/ops/`.

Each drop-in takes the kernel wrapper's arguments and writes the same outputs and bytes (see its docstring and
unit test). REPLACE at the defining module; HookRegistry propagates it to every `from X import Y` binding.
Three drop-ins must hand back sglang's own types or call sglang's own torch code; they live here, beside the
table, because `ops/` imports no sglang: the two compressor planners (sglang's plan NamedTuples around the
plan bytes of `ops.compress_plan`) and the hc head (sglang's `hc_head_torch`).
"""

from __future__ import annotations

from typing import Any

import torch

from flashmemory.sglang.cpu.ops.compress_plan import plan_decode, plan_prefill
from flashmemory.sglang.plumbing.patch_spec import Patch

_NR = "sglang.kernels.ops.attention.dsv4.norm_rope"
_CP = "sglang.kernels.ops.attention.dsv4.compress"
_MHC = "sglang.kernels.ops.layernorm.mhc"
_OPS = "flashmemory.sglang.cpu.ops"
_K = "flashmemory.sglang.cpu.patches_kernels"


def generate_prefill(
    compress_ratio: int,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_state: torch.Tensor,
    swa_page_size: int,
    ring_size: int,
    num_q_tokens: int,
    use_cuda_graph: bool = False,
    use_req_ring: bool = False,
) -> Any:
    """Drop-in for `CompressorPrefillPlan.generate` (same arguments): sglang's NamedTuple around
    `ops.compress_plan.plan_prefill`'s (plan_c, plan_w) bytes, pin_buffer None."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    plan_c, plan_w = plan_prefill(
        compress_ratio,
        req_pool_indices,
        seq_lens,
        extend_lens,
        req_to_token,
        full_to_state,
        swa_page_size,
        ring_size,
        num_q_tokens,
        use_cuda_graph,
        use_req_ring,
    )
    return CompressorPrefillPlan(compress_ratio, plan_c, plan_w, None)


def generate_decode(
    compress_ratio: int,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_state: torch.Tensor,
    seq_lens: torch.Tensor,
    swa_page_size: int,
    ring_size: int,
    use_req_ring: bool = False,
) -> Any:
    """Drop-in for `CompressorDecodePlan.generate` (same arguments): sglang's NamedTuple around
    `ops.compress_plan.plan_decode`'s plan_d bytes."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    plan_d = plan_decode(
        compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, swa_page_size, ring_size, use_req_ring
    )
    return CompressorDecodePlan(compress_ratio, plan_d)


def fused_hc_head(
    x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    """Drop-in for `kernels/ops/layernorm/mhc_head.py::fused_hc_head` (Triton): sglang's own torch version
    `srt/models/deepseek_v4.py:664 hc_head_torch` (imported on first use). x [T, hc, H] -> y [T, H] in x's dtype."""
    from sglang.srt.models.deepseek_v4 import hc_head_torch

    return hc_head_torch(x, hc_fn, hc_scale, hc_base, norm_eps=norm_eps, hc_eps=hc_eps)


def _k(target: str, impl: str, params: tuple[str, ...], why: str) -> Patch:
    return Patch("cpu", target, "replace", impl, params, why)


KERNEL_PATCHES: tuple[Patch, ...] = (
    _k(
        f"{_NR}.fused_q_norm_rope",
        f"{_OPS}.norm_rope:fused_q_norm_rope",
        ("q_input", "q_output", "eps", "freqs_cis"),
        "norm_rope.py:193 JIT q RMSNorm + RoPE (deepseek_v4.py:1798)",
    ),
    _k(
        f"{_NR}.fused_rope_inplace",
        f"{_OPS}.norm_rope:fused_rope_inplace",
        ("q", "k", "freqs_cis", "positions"),
        "norm_rope.py:142 JIT RoPE (deepseek_v4.py:1810,2954)",
    ),
    _k(
        f"{_NR}.fused_norm_rope_inplace",
        f"{_OPS}.norm_rope:fused_norm_rope_inplace",
        ("kv", "weight", "eps"),
        "norm_rope.py:173 JIT RMSNorm + RoPE (deepseek_v4.py:1882)",
    ),
    _k(
        f"{_NR}.fused_k_norm_rope_flashmla",
        f"{_OPS}.norm_rope:fused_k_norm_rope_flashmla",
        ("kv", "kv_weight", "eps", "freqs_cis"),
        "norm_rope.py:304 JIT SWA k norm + RoPE + 584-B fp8 store (deepseek_v4_memory_pool.py:2218)",
    ),
    _k(
        f"{_NR}.fused_q_indexer_rope_hadamard_quant",
        f"{_OPS}.indexer_q:fused_q_indexer_rope_hadamard_quant",
        ("q_input", "weight", "weight_scale"),
        "norm_rope.py:223 JIT indexer-q RoPE + Hadamard + fp8 (dsv4/indexer.py:1242)",
    ),
    _k(
        f"{_CP}.CompressorPrefillPlan.generate",
        f"{_K}:generate_prefill",
        ("compress_ratio", "req_pool_indices", "seq_lens", "extend_lens"),
        "compress.py:255 JIT c_plan.cuh planner + pinned staging (compressor_v2.py:423)",
    ),
    _k(
        f"{_CP}.CompressorDecodePlan.generate",
        f"{_K}:generate_decode",
        ("compress_ratio", "req_pool_indices", "req_to_token"),
        "compress.py:168 JIT planner (compressor_v2.py:437)",
    ),
    _k(
        f"{_CP}.compress_forward",
        f"{_OPS}.compressor:compress_forward",
        ("kv_score_buffer", "kv_score_input", "ape", "plan"),
        "compress.py:404 JIT c4_v2.cuh / c128_v2.cuh compression (compressor_v2.py:112)",
    ),
    _k(
        f"{_CP}.compress_norm_rope_store",
        f"{_OPS}.norm_rope:compress_norm_rope_store",
        ("kv", "plan"),
        "compress.py:445 JIT fused_norm_rope_v2.cuh norm + RoPE + fp8 paged store (compressor_v2.py:130)",
    ),
    _k(
        f"{_MHC}.hc_split_sinkhorn",
        f"{_OPS}.mhc:hc_split_sinkhorn",
        ("mixes", "hc_scale", "hc_base"),
        "mhc.py:427 TileLang Sinkhorn (deepseek_v4.py:3483 via get_mhc_ops)",
    ),
    _k(
        f"{_MHC}.mhc_combine",
        f"{_OPS}.mhc:mhc_combine",
        ("x_flat", "pre", "hc"),
        "mhc.py:2743 Triton pre-weighted combine (deepseek_v4.py:3502,4594)",
    ),
    _k(
        "sglang.kernels.ops.layernorm.mhc_head.fused_hc_head",
        f"{_K}:fused_hc_head",
        ("x", "hc_fn", "hc_scale", "hc_base"),
        "mhc_head.py:90 Triton hc head -> sglang's own hc_head_torch (deepseek_v4.py:3935)",
    ),
    _k(
        "sglang.kernels.ops.attention.dsv4.attn.fused_store_cache",
        f"{_OPS}.stores:fused_store_cache",
        ("input", "cache", "indices"),
        "attn.py:75 JIT store.cuh fp8 paged store (deepseek_v4_memory_pool.py:357,703,2185)",
    ),
    _k(
        "sglang.kernels.ops.attention.dsv4.metadata_kernel.init_compression_metadata",
        f"{_OPS}.metadata:init_compression_metadata",
        ("seq_lens", "positions", "raw_out_loc", "page_table"),
        "metadata_kernel.py:270 Triton per-token metadata, interpreted on CPU (deepseek_v4_backend.py:772)",
    ),
    _k(
        "sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp",
        f"{_OPS}.activation:silu_and_mul_clamp",
        ("input", "output"),
        "silu_and_mul_clamp.py:57 JIT clamped SwiGLU (deepseek_v2.py:490)",
    ),
)
