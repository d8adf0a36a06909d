"""CUDA-only kernels on sglang's DSv4 prefill/decode path -> the pure-torch drop-ins beside this module.

Each drop-in takes the kernel wrapper's arguments and writes the same outputs and bytes (see its docstring and
unit test). REPLACE at the defining module; HookRegistry propagates it to every `from X import Y` binding.
"""

from __future__ import annotations

from flashmemory.sglang.cpu.patch_spec import CpuPatch

_NR = "sglang.kernels.ops.attention.dsv4.norm_rope"
_CP = "sglang.kernels.ops.attention.dsv4.compress"
_MHC = "sglang.kernels.ops.layernorm.mhc"
_OPS = "flashmemory.sglang.cpu"

KERNEL_PATCHES: tuple[CpuPatch, ...] = (
    CpuPatch(f"{_NR}.fused_q_norm_rope", "replace", f"{_OPS}.norm_rope:fused_q_norm_rope",
             ("q_input", "q_output", "eps", "freqs_cis"), "norm_rope.py:193 JIT q RMSNorm + RoPE (deepseek_v4.py:1798)"),
    CpuPatch(f"{_NR}.fused_rope_inplace", "replace", f"{_OPS}.norm_rope:fused_rope_inplace",
             ("q", "k", "freqs_cis", "positions"), "norm_rope.py:142 JIT RoPE (deepseek_v4.py:1810,2954)"),
    CpuPatch(f"{_NR}.fused_norm_rope_inplace", "replace", f"{_OPS}.norm_rope:fused_norm_rope_inplace",
             ("kv", "weight", "eps"), "norm_rope.py:173 JIT RMSNorm + RoPE (deepseek_v4.py:1882)"),
    CpuPatch(f"{_NR}.fused_k_norm_rope_flashmla", "replace", f"{_OPS}.norm_rope:fused_k_norm_rope_flashmla",
             ("kv", "kv_weight", "eps", "freqs_cis"),
             "norm_rope.py:304 JIT SWA k norm + RoPE + 584-B fp8 store (deepseek_v4_memory_pool.py:2218)"),
    CpuPatch(f"{_NR}.fused_q_indexer_rope_hadamard_quant", "replace",
             f"{_OPS}.indexer_q:fused_q_indexer_rope_hadamard_quant", ("q_input", "weight", "weight_scale"),
             "norm_rope.py:223 JIT indexer-q RoPE + Hadamard + fp8 (dsv4/indexer.py:1242)"),
    CpuPatch(f"{_CP}.CompressorPrefillPlan.generate", "replace", f"{_OPS}.compress_plan:generate_prefill",
             ("compress_ratio", "req_pool_indices", "seq_lens", "extend_lens"),
             "compress.py:255 JIT c_plan.cuh planner + pinned staging (compressor_v2.py:423)"),
    CpuPatch(f"{_CP}.CompressorDecodePlan.generate", "replace", f"{_OPS}.compress_plan:generate_decode",
             ("compress_ratio", "req_pool_indices", "req_to_token"), "compress.py:168 JIT planner (compressor_v2.py:437)"),
    CpuPatch(f"{_CP}.compress_forward", "replace", f"{_OPS}.compressor:compress_forward",
             ("kv_score_buffer", "kv_score_input", "ape", "plan"),
             "compress.py:404 JIT c4_v2.cuh / c128_v2.cuh compression (compressor_v2.py:112)"),
    CpuPatch(f"{_CP}.compress_norm_rope_store", "replace", f"{_OPS}.norm_rope:compress_norm_rope_store",
             ("kv", "plan"), "compress.py:445 JIT fused_norm_rope_v2.cuh norm + RoPE + fp8 paged store "
             "(compressor_v2.py:130)"),
    CpuPatch(f"{_MHC}.hc_split_sinkhorn", "replace", f"{_OPS}.mhc:hc_split_sinkhorn",
             ("mixes", "hc_scale", "hc_base"), "mhc.py:427 TileLang Sinkhorn (deepseek_v4.py:3483 via get_mhc_ops)"),
    CpuPatch(f"{_MHC}.mhc_combine", "replace", f"{_OPS}.mhc:mhc_combine",
             ("x_flat", "pre", "hc"), "mhc.py Triton pre-weighted combine (deepseek_v4.py:3502,4594)"),
    CpuPatch("sglang.kernels.ops.layernorm.mhc_head.fused_hc_head", "replace", f"{_OPS}.mhc:fused_hc_head",
             ("x", "hc_fn", "hc_scale", "hc_base"),
             "mhc_head.py:90 Triton hc head -> sglang's own hc_head_torch (deepseek_v4.py:3935)"),
    CpuPatch("sglang.kernels.ops.attention.dsv4.attn.fused_store_cache", "replace", f"{_OPS}.stores:fused_store_cache",
             ("input", "cache", "indices"),
             "attn.py:75 JIT store.cuh fp8 paged store (deepseek_v4_memory_pool.py:357,703,2185)"),
    CpuPatch("sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp", "replace",
             f"{_OPS}.activation:silu_and_mul_clamp", ("input", "output"),
             "silu_and_mul_clamp.py:57 JIT clamped SwiGLU (deepseek_v2.py:490)"),
)
