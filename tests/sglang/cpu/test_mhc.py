"""mHC Sinkhorn split and combine against transformers' DeepseekV4HyperConnection on the same weights;
the hc head (sglang's own hc_head_torch) against transformers' DeepseekV4HyperHead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashmemory.hf.models import config_dict, make_config
from flashmemory.sglang.cpu.ops.mhc import hc_split_sinkhorn, mhc_combine

tr = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _hc_module(cls, seed: int):
    cfg = make_config(config_dict("micro"))
    m = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() == 2 else 1.0))
    return cfg, m


def test_sinkhorn_and_combine_match_transformers():
    cfg, hc = _hc_module(tr.DeepseekV4HyperConnection, 0)
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(2, 5, cfg.hc_mult, cfg.hidden_size, generator=g).bfloat16()
    with torch.no_grad():
        post_ref, comb_ref, collapsed_ref = hc(streams)
        # sglang's hc_pre_torch_impl (srt/models/deepseek_v4.py:3358): mixes = (x_flat @ fn^T) * rsqrt(ms + eps)
        x_flat = streams.reshape(10, -1).float()
        mixes = (
            F.linear(x_flat, hc.fn.float()) * torch.rsqrt(x_flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
        ).unsqueeze(1)
        pre, post, comb = hc_split_sinkhorn(mixes, hc.scale, hc.base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        y = mhc_combine(x_flat, pre.squeeze(1), cfg.hc_mult, torch.bfloat16)
    assert pre.shape == (10, 1, 4) and comb.shape == (10, 1, 4, 4)
    torch.testing.assert_close(post.view(2, 5, 4), post_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.view(2, 5, 4, 4), comb_ref, rtol=1e-5, atol=1e-6)
    assert (comb.sum(-1) - 1).abs().max() < 1e-3 and (comb.sum(-2) - 1).abs().max() < 1e-3  # doubly stochastic
    err = (y.view(2, 5, -1).double() - collapsed_ref.double()).abs()
    assert bool((err <= 2**-8 * collapsed_ref.double().abs() + 1e-6).all())


def test_hc_head_torch_matches_transformers():
    """No new op: the patch routes fused_hc_head to sglang's hc_head_torch; check that mapping's math."""
    dsv4 = pytest.importorskip("sglang.srt.models.deepseek_v4")
    cfg, head = _hc_module(tr.DeepseekV4HyperHead, 2)
    x = torch.randn(6, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        want = head(x.unsqueeze(0))[0]
        got = dsv4.hc_head_torch(
            x,
            head.hc_fn.float(),
            head.hc_scale.float(),
            head.hc_base.float(),
            norm_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
        )
    err = (got.double() - want.double()).abs()
    assert bool((err <= 2**-8 * want.double().abs() + 1e-6).all())
