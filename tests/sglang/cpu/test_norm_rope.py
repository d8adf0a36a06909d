"""q / k norm + rope (+ 584-B store) against float64 formulas written here."""

from __future__ import annotations

import pytest
import torch

from flashmemory.retriever.rope import RopeConfig, yarn_inv_freq
from flashmemory.sglang.cpu.ops.compress_plan import plan_decode
from flashmemory.sglang.cpu.ops.norm_rope import (
    compress_norm_rope_store,
    fused_k_norm_rope_flashmla,
    fused_norm_rope_inplace,
    fused_q_norm_rope,
    fused_rope_inplace,
)
from flashmemory.sglang.cpu.ops.stores import dequantize_kv_entries, kv_page_format

EPS = 1e-6


def _freqs(n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(complex64 freqs_cis [n, 32] as sglang holds it, float64 angles [n, 32]) for DSv4's compressed YaRN rope."""
    ang = torch.arange(n, dtype=torch.float64).unsqueeze(1) * yarn_inv_freq(RopeConfig(theta=160000.0))
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64), ang


def _rope64(x: torch.Tensor, ang: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """float64 interleaved rope of x [..., 64] with angles [..., 32] (complex multiply by e^{+-i ang})."""
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], 32, 2).contiguous())
    rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang)
    return torch.view_as_real(z * rot).flatten(-2)


def _ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results: within one bf16 rounding (2^-8 relative) of the float64 value, and mostly exact."""
    err = (got.double() - want).abs()
    assert bool((err <= 2**-8 * want.abs() + 1e-30).all()), f"worst rel err {(err / want.abs()).max().item():.2e}"
    exact = (got.double() == want.to(got.dtype).double()).float().mean().item()
    assert exact > 0.98, f"only {exact:.3f} of the values are the correctly rounded float64 result"


@pytest.mark.parametrize("eps", [EPS, None])
def test_q_norm_rope(eps):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(5, 3, 512, generator=g) * 3).bfloat16()
    pos = torch.tensor([0, 1, 77, 4000, 1234])
    freqs, ang = _freqs()
    out = torch.empty_like(q)
    fused_q_norm_rope(q, out, eps, freqs, pos)
    x = q.double()
    if eps is not None:
        x = (x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)).bfloat16().double()  # kernel rounds here
    want = torch.cat([x[..., :448], _rope64(x[..., 448:], ang[pos].unsqueeze(1))], dim=-1)
    _ulp_close(out, want)
    out8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn)
    fused_q_norm_rope(q, out8, eps, freqs, pos)
    assert torch.equal(out8.view(torch.uint8), out.to(torch.float8_e4m3fn).view(torch.uint8))


def test_rope_inplace_forward_and_inverse_on_strided_views():
    g = torch.Generator().manual_seed(1)
    o = torch.randn(4, 2, 512, generator=g).bfloat16()
    o0 = o.clone()
    pos = torch.tensor([3, 9, 100, 2047])
    freqs, ang = _freqs()
    fused_rope_inplace(o[..., -64:], None, freqs, pos, inverse=True)
    _ulp_close(o[..., -64:], _rope64(o0[..., -64:], ang[pos].unsqueeze(1), inverse=True))
    assert torch.equal(o[..., :448], o0[..., :448])
    k = torch.randn(4, 1, 64, generator=g).bfloat16()
    k0 = k.clone()
    q = o[..., -64:].clone()
    fused_rope_inplace(q, k, freqs, pos)
    _ulp_close(k, _rope64(k0, ang[pos].unsqueeze(1)))


def test_norm_rope_inplace():
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(6, 512, generator=g).bfloat16()
    w = (1 + 0.2 * torch.randn(512, generator=g)).bfloat16()
    pos = torch.arange(6) * 31
    freqs, ang = _freqs()
    kv0 = kv.double()
    fused_norm_rope_inplace(kv, w, EPS, freqs, pos)
    y = kv0 / torch.sqrt(kv0.square().mean(-1, keepdim=True) + EPS) * w.double()
    _ulp_close(kv, torch.cat([y[:, :448], _rope64(y[:, 448:], ang[pos])], dim=1))


def test_k_norm_rope_store_into_swa_pool():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 64 + 512, generator=g).bfloat16()
    kv = qkv[:, 64:]  # a strided slice, as sglang passes qkv_a[..., q_lora_rank:]
    w = (1 + 0.2 * torch.randn(512, generator=g)).bfloat16()
    pos = torch.tensor([0, 5, 6, 700, 3000])
    out_loc = torch.tensor([3, -1, 64, 65, 200], dtype=torch.int32)  # -1: no SWA slot, skipped
    freqs, ang = _freqs()
    fmt = kv_page_format(64)
    pool = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8)
    fused_k_norm_rope_flashmla(kv, w, EPS, freqs, pos, out_loc, pool, 64)
    x = kv.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS) * w.double()
    want = torch.cat([y[:, :448], _rope64(y[:, 448:], ang[pos])], dim=1)
    keep = out_loc >= 0
    locs = out_loc[keep].long()
    rows = fmt.read_chunks(pool, locs // 64, locs % 64)
    deq = dequantize_kv_entries(rows).double()
    s = (rows[:, 576:583].to(torch.int32) << 23).view(torch.float32).double().repeat_interleave(64, dim=1)
    ref = want[keep]
    bound = torch.cat([2**-4 * ref[:, :448].abs() + 2**-10 * s, 2**-8 * ref[:, 448:].abs()], dim=1) + 1e-6
    assert bool(((deq - ref).abs() <= bound).all())
    assert int(pool.count_nonzero()) > 0
    untouched = torch.ones(4 * 64, dtype=torch.bool)
    untouched[locs] = False
    assert (
        int(
            fmt.read_chunks(pool, torch.arange(256)[untouched] // 64, torch.arange(256)[untouched] % 64).count_nonzero()
        )
        == 0
    )


def test_compress_store_rejects_unsupported_layouts():
    plan_d = plan_decode(
        4,
        torch.tensor([0]),
        torch.zeros(1, 8, dtype=torch.int32),
        torch.zeros(8, dtype=torch.int64),
        torch.tensor([4]),
        16,
        8,
    )
    plan = type("P", (tuple,), {"compress_ratio": 4, "is_decode": True})((4, plan_d))
    args = dict(
        norm_weight=torch.ones(128),
        norm_eps=EPS,
        freq_cis=_freqs(8)[0],
        out_loc=torch.zeros(1, dtype=torch.long),
        kvcache=torch.zeros(1, 64 * 68, dtype=torch.uint8),
        page_size=64,
    )
    with pytest.raises(NotImplementedError, match="use_fp4"):
        compress_norm_rope_store(torch.zeros(1, 128), plan, use_fp4=True, **args)
