"""The C4 lightning-indexer query on CPU: RoPE + 128-point Hadamard + per-head fp8 quantization.

Drop-in for `kernels/ops/attention/dsv4/norm_rope.py::fused_q_indexer_rope_hadamard_quant` (JIT kernel
`FusedQIndexerRopeHadamardQuantKernel`, `main_norm_rope.cuh`; called from `srt/layers/attention/dsv4/indexer.py:1242`):

- q_input [B, H, 128] (bf16): no norm; the last 64 dims are rope'd (interleaved pairs) at positions [B] in fp32;
- Walsh-Hadamard rotation of all 128 dims, scale 128^-0.5 (natural/Sylvester order, the kernel's butterfly);
- per (token, head) fp8: scale = max(amax, 1e-4) / 448, q_fp8 = e4m3(clamp(x * (1/scale), +-448));
- weights_out [B, H, 1] fp32 = weight[b, h] * weight_scale * scale, so that
  sum_h relu(q_fp8 . k) * weights_out = the indexer logit with q's quantization scale folded in.
"""

from __future__ import annotations

import torch

from flashmemory.retriever.fp8 import FP8, FP8_MAX
from flashmemory.retriever.hadamard import hadamard_transform
from flashmemory.sglang.cpu.ops.norm_rope import cos_sin_table, rope_interleaved
from flashmemory.sglang.cpu.ops.stores import SCALE_EPS

INDEX_HEAD_DIM = 128
ROPE_DIM = 64


def fused_q_indexer_rope_hadamard_quant(
    q_input: torch.Tensor, weight: torch.Tensor, weight_scale: float, freqs_cis: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_input [B, H, 128], weight [B, H] (may have a batch stride), freqs_cis complex [max_pos, 32],
    positions [B] -> (q_fp8 float8_e4m3fn [B, H, 128], weights_out float32 [B, H, 1])."""
    if q_input.dim() != 3 or q_input.shape[-1] != INDEX_HEAD_DIM:
        raise ValueError(f"q_input must be [B, H, {INDEX_HEAD_DIM}], got {tuple(q_input.shape)}")
    b, h, _ = q_input.shape
    if tuple(weight.shape) != (b, h):
        raise ValueError(f"weight must be [{b}, {h}], got {tuple(weight.shape)}")
    x = q_input.float()
    cs = cos_sin_table(freqs_cis)[positions.long().cpu()].to(x.device).unsqueeze(1)  # [B, 1, 64]
    x = torch.cat([x[..., :-ROPE_DIM], rope_interleaved(x[..., -ROPE_DIM:], cs)], dim=-1)
    x = hadamard_transform(x)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(SCALE_EPS) / FP8_MAX  # [B, H, 1]
    q_fp8 = (x * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    weights_out = weight.float().unsqueeze(-1) * float(weight_scale) * scale
    return q_fp8, weights_out
