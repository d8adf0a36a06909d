"""DSv4's clamped SwiGLU on CPU: a drop-in for `kernels/ops/activation/silu_and_mul_clamp.py::silu_and_mul_clamp`
(JIT `SiluAndMulClampKernel`, `silu_and_mul_masked_post_quant.cuh`; called from `srt/models/deepseek_v2.py:490`)."""

from __future__ import annotations

import torch


def silu_and_mul_clamp(input: torch.Tensor, output: torch.Tensor, swiglu_limit: float) -> None:
    """input [M, 2N] = [gate | up] (bf16/fp16) -> output [M, N] (written in place):
    silu(min(gate, L)) * clamp(up, -L, L), with the clamps done in the input dtype (L rounded to it, as the
    kernel's bf16 __hmin2/__hmax2) and silu and the product in fp32, rounded once to output's dtype.
    """
    if input.dim() != 2 or input.shape[1] % 2 or tuple(output.shape) != (input.shape[0], input.shape[1] // 2):
        raise ValueError(
            f"silu_and_mul_clamp: input [M, 2N] and output [M, N] expected, got "
            f"{tuple(input.shape)} and {tuple(output.shape)}"
        )
    n = input.shape[1] // 2
    lim = torch.tensor(float(swiglu_limit), dtype=input.dtype)
    gate = torch.minimum(input[:, :n], lim).float()
    up = torch.maximum(torch.minimum(input[:, n:], lim), -lim).float()
    output.copy_((gate * torch.sigmoid(gate) * up).to(output.dtype))
