"""RMSNorm + interleaved RoPE (+ fp8 paged store) of DSv4's q, SWA k and compressed entries, on CPU.

Drop-ins for `kernels/ops/attention/dsv4/norm_rope.py` (`fused_rope_inplace`, `fused_norm_rope_inplace`,
`fused_q_norm_rope`, `fused_k_norm_rope_flashmla`) and `compress.py::compress_norm_rope_store`, written from the
JIT sources `rope.cuh`, `main_norm_rope.cuh`, `fused_norm_rope_v2.cuh`:

- `freqs_cis` is sglang's complex64 table [max_pos, rope/2] (unit magnitude); its real view [max_pos, rope]
  holds (cos, sin) pairs. RoPE rotates the *last* `rope` dims as interleaved (real, imag) pairs (2i, 2i+1);
  inverse RoPE uses the conjugate.
- RMSNorm: x * rsqrt(mean(x^2) + eps) (* weight), all in fp32.
- Precision, as the kernels: q norm rounds the normed head to the q dtype before the rope rotation; SWA k and
  compressed entries are normed and rotated in fp32 and rounded only by the store (see `stores`).
"""

from __future__ import annotations

from typing import Any

import torch

from flashmemory.retriever.hadamard import hadamard_transform
from flashmemory.sglang.cpu.ops.compress_plan import unpack_plan_c, unpack_plan_d
from flashmemory.sglang.cpu.ops.stores import INDEX_HEAD_DIM, KV_DIM, store_index_entries, store_kv_entries


def cos_sin_table(freqs_cis: torch.Tensor) -> torch.Tensor:
    """complex [max_pos, R/2] -> fp32 [max_pos, R] interleaved (cos, sin); a real [max_pos, R] table passes."""
    if freqs_cis.is_complex():
        return torch.view_as_real(freqs_cis).flatten(-2).float()
    return freqs_cis.float()


def rope_interleaved(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate x [..., R] float32 by cos_sin [..., R] (interleaved cos, sin; broadcastable) -> fp32 [..., R]."""
    xr, xi = x[..., 0::2], x[..., 1::2]
    c, s = cos_sin[..., 0::2], cos_sin[..., 1::2]
    if inverse:
        s = -s
    return torch.stack((xr * c - xi * s, xr * s + xi * c), dim=-1).flatten(-2)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) (* weight)."""
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def norm_rope(x: torch.Tensor, eps: float, weight: torch.Tensor | None, cos_sin_rows: torch.Tensor) -> torch.Tensor:
    """fp32 [N, D]: RMSNorm, then RoPE of the last R dims with cos_sin_rows [N, R] (one row per token)."""
    y = rms_norm(x, eps, weight)
    r = cos_sin_rows.shape[-1]
    return torch.cat([y[:, :-r], rope_interleaved(y[:, -r:], cos_sin_rows)], dim=1)


def fused_rope_inplace(
    q: torch.Tensor, k: torch.Tensor | None, freqs_cis: torch.Tensor, positions: torch.Tensor, inverse: bool = False
) -> None:
    """Drop-in for `fused_rope_inplace`: q [B, Hq, R] and k [B, Hk, R] (or None) rotated in place at positions [B]
    (fp32 math, stored back in their dtype). Works on strided views (e.g. `q[..., -64:]`)."""
    cs = cos_sin_table(freqs_cis)[positions.long().cpu()].to(q.device)
    for t in (q, k):
        if t is None:
            continue
        rows = cs.view(cs.shape[0], *([1] * (t.dim() - 2)), cs.shape[-1])
        t.copy_(rope_interleaved(t.float(), rows, inverse).to(t.dtype))


def fused_norm_rope_inplace(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, freq_cis: torch.Tensor, positions: torch.Tensor
) -> None:
    """Drop-in for `fused_norm_rope_inplace`: kv [N, D] normed (weighted) and rope'd in place, rounded to kv.dtype."""
    cs = cos_sin_table(freq_cis)[positions.long().cpu()].to(kv.device)
    kv.copy_(norm_rope(kv, eps, weight, cs).to(kv.dtype))


def fused_q_norm_rope(
    q_input: torch.Tensor, q_output: torch.Tensor, eps: float | None, freqs_cis: torch.Tensor, positions: torch.Tensor
) -> None:
    """Drop-in for `fused_q_norm_rope`: q_input [B, H, D] (bf16) -> q_output [B, H, D] (bf16 or float8_e4m3fn).

    Per (token, head): unweighted RMSNorm when eps is not None, rounded to q_input's dtype, then RoPE of the
    last R dims in fp32, rounded again. An fp8 q_output receives torch's cast of that bf16 result (as sglang).
    """
    dt = q_input.dtype
    x = q_input.float()
    if eps is not None:
        x = rms_norm(x, eps).to(dt).float()
    cs = cos_sin_table(freqs_cis)
    r = cs.shape[-1]
    rows = cs[positions.long().cpu()].to(q_input.device).unsqueeze(1)
    out = torch.cat([x[..., :-r].to(dt), rope_interleaved(x[..., -r:], rows).to(dt)], dim=-1)
    q_output.copy_(out)


def fused_k_norm_rope_flashmla(
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
    layout: Any = "v4",
    q: torch.Tensor | None = None,
) -> None:
    """Drop-in for `fused_k_norm_rope_flashmla` (V4 layout, no fused q rope): kv [B, 512] (may be a strided
    slice) -> weighted RMSNorm + RoPE in fp32 -> 584-B entries at out_loc [B] (negative = no write)."""
    if str(getattr(layout, "value", layout)).lower() != "v4":
        raise NotImplementedError(f"fused_k_norm_rope_flashmla on CPU supports the V4 layout only, got {layout!r}")
    if q is not None:
        raise NotImplementedError("the fused query rope of fused_k_norm_rope_flashmla is ROCm-only in sglang")
    if kv.shape[-1] != KV_DIM:
        raise ValueError(f"kv must be [B, {KV_DIM}], got {tuple(kv.shape)}")
    cs = cos_sin_table(freqs_cis)[positions.long().cpu()].to(kv.device)
    store_kv_entries(kvcache, out_loc, norm_rope(kv, eps, kv_weight, cs), page_size, round_nope_to_bf16=False)


def compress_norm_rope_store(
    kv: torch.Tensor,
    plan: Any,
    *,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freq_cis: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
    use_fp4: bool = False,
    bf16_store: bool = False,
    kvcache_scale: torch.Tensor | None = None,
    rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp4_k_write_metadata: Any = None,
    layout: Any = "v4",
    fp8_2buff: bool = False,
    kvcache_rope: torch.Tensor | None = None,
) -> None:
    """Drop-in for sglang's `compress_norm_rope_store` (V4 layout, fp8 stores).

    kv [rows, D] = `compress_forward`'s output (one row per plan row); only rows that closed a window are
    stored: prefill plan_c rows that are valid (loc = out_loc[ragged_id]), decode rows with
    seq_len % ratio == 0 (loc = out_loc[row]). Each is RMSNorm'ed with norm_weight, rope'd at the window's
    first position seq_len - ratio, and stored:
    - D = 512 (attention compressor): 584-B entry, nope dims rounded to bf16 before fp8 (as the CUDA store);
    - D = 128 (indexer compressor): Walsh-Hadamard rotation (scale 128^-0.5) then the 132-B entry.
    """
    unsupported = {
        "use_fp4": use_fp4,
        "bf16_store": bf16_store,
        "fp8_2buff": fp8_2buff,
        "kvcache_scale": kvcache_scale is not None,
        "rope_cache": rope_cache is not None,
        "kvcache_rope": kvcache_rope is not None,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad or str(getattr(layout, "value", layout)).lower() != "v4":
        raise NotImplementedError(
            f"compress_norm_rope_store on CPU supports the V4 fp8 layout only "
            f"(unsupported here: {bad or [f'layout={layout!r}']})"
        )
    d = kv.shape[-1]
    if d not in (KV_DIM, INDEX_HEAD_DIM):
        raise ValueError(f"compressed rows must be {KV_DIM} or {INDEX_HEAD_DIM} wide, got {d}")
    ratio = plan.compress_ratio
    if plan.is_decode:
        p = unpack_plan_d(plan[1].cpu())
        rows = torch.nonzero(p.seq_len % ratio == 0).flatten()
        locs = out_loc.cpu().long()[rows]
    else:
        p = unpack_plan_c(plan[1].cpu())
        rows = torch.nonzero(p.valid).flatten()
        locs = out_loc.cpu().long()[p.ragged_id[rows]]
    if rows.numel() == 0:
        return
    pos = p.seq_len[rows] - ratio
    cs = cos_sin_table(freq_cis)[pos].to(kv.device)
    y = norm_rope(kv[rows.to(kv.device)], norm_eps, norm_weight.to(kv.dtype), cs)
    if d == KV_DIM:
        store_kv_entries(kvcache, locs, y, page_size, round_nope_to_bf16=True)
    else:
        store_index_entries(kvcache, locs, hadamard_transform(y), page_size)
