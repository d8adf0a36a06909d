"""mHC (manifold-constrained hyper-connections) ops of DSv4 on CPU: Sinkhorn split and the pre-weighted combine.

Drop-ins for `kernels/ops/layernorm/mhc.py::hc_split_sinkhorn` (TileLang kernel `hc_split_sinkhorn_kernel`) and
`mhc.py::mhc_combine` (Triton `_mhc_combine_kernel`), called from `srt/models/deepseek_v4.py:3483,3502` (the
torch hc-pre path, taken with SGLANG_OPT_USE_TILELANG_MHC_PRE=0, SGLANG_OPT_FUSE_MHC_POST_PRE=0,
SGLANG_OPT_DEEPGEMM_HC_PRENORM=0). The hc head needs nothing new: sglang's own `hc_head_torch`
(`srt/models/deepseek_v4.py:664`) takes `fused_hc_head`'s arguments (x, hc_fn, hc_scale, hc_base,
norm_eps=, hc_eps=): `cpu/patches_kernels.py` routes `mhc_head.fused_hc_head` to it.
"""

from __future__ import annotations

import torch


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int = 4,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [b, s, (2+hc)*hc] fp32, hc_scale [3], hc_base [(2+hc)*hc] -> (pre [b,s,hc], post [b,s,hc],
    comb [b,s,hc,hc]) in mixes' dtype, computed in fp32:

    pre = sigmoid(m[:hc] * s0 + base) + eps; post = 2 * sigmoid(m[hc:2hc] * s1 + base);
    comb = row-softmax(m[2hc:].view(hc, hc) * s2 + base) + eps, then comb /= (column sums + eps), then
    (sinkhorn_iters - 1) x [rows /= (row sums + eps); columns /= (column sums + eps)].
    """
    b, s, width = mixes.shape
    hc = hc_mult
    if width != (2 + hc) * hc:
        raise ValueError(f"mixes last dim must be (2+hc)*hc = {(2 + hc) * hc}, got {width}")
    m = mixes.float()
    sc, base = hc_scale.float(), hc_base.float()
    pre = torch.sigmoid(m[..., :hc] * sc[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * sc[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * sc[2] + base[2 * hc :]).view(b, s, hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre.to(mixes.dtype), post.to(mixes.dtype), comb.to(mixes.dtype)


def mhc_combine(x_flat: torch.Tensor, pre: torch.Tensor, hc: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y[m, h] = sum_k pre[m, k] * x_flat[m, k*H + h], accumulated in fp32 over k = 0..hc-1 in order.

    x_flat [M, hc*H] (any float dtype, last dim contiguous), pre [M, hc] -> y [M, H] out_dtype.
    """
    m, width = x_flat.shape
    if width % hc:
        raise ValueError(f"x_flat width {width} is not a multiple of hc={hc}")
    x = x_flat.reshape(m, hc, width // hc).float()
    p = pre.float()
    acc = torch.zeros(m, width // hc, dtype=torch.float32, device=x_flat.device)
    for k in range(hc):
        acc += p[:, k : k + 1] * x[:, k]
    return acc.to(out_dtype)
