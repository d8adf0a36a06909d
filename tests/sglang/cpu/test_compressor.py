"""The CPU compressor (plan + compress + norm/rope + fp8 store) against transformers' DSv4 compressors.

Reference: transformers 5.19 `DeepseekV4CSACompressor` (c4, with its indexer's own c4 compressor) and
`DeepseekV4HCACompressor` (c128) on the same weights, one shot over each whole request (fp32, no fp8).

Bounds, and why:
- fp32 path (compress_forward + norm + rope, before the store) vs transformers: 2e-5 relative to the
  entry's max; both are fp32 with different summation orders (measured ~1e-6).
- stored entries, dequantized: nope dims are bf16-rounded then e4m3 with a power-of-two group scale s:
  |err| <= 2^-8 |r| (bf16 unit roundoff) + 2^-4 |bf16(r)| (half an e4m3 ulp, relative)
  + 2^-10 s (half the subnormal step);
  rope dims bf16: 2^-8 |r|; index keys e4m3 with scale s = amax/448: 2^-4 |r| + 2^-10 s; all plus the
  fp32 tolerance above.
- chunked prefill + decode steps vs one-shot prefill: identical bytes (same fp32 inputs, same order).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashmemory.hf.models import config_dict, make_config
from flashmemory.retriever.fp8 import dequantize_chunks
from flashmemory.retriever.hadamard import hadamard_transform
from flashmemory.sglang.cpu.ops.stores import dequantize_kv_entries
from tests.sglang.cpu.compress_harness import CompressorSetup, run

tr = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

HIDDEN = 64
LENS = {0: 300, 2: 263}  # request slot -> total tokens (different slots, different lengths)
# (batch of (rid, start, end), is_decode): chunked prefill with both requests, then decode steps.
CHUNKED = (
    [([(0, 0, 37), (2, 0, 50)], False), ([(0, 37, 137), (2, 50, 200)], False), ([(0, 137, 227)], False)]
    # Request 2 decodes alongside request 0 (27 positions behind) until it reaches its 263 tokens.
    + [([(0, p, p + 1)] + ([(2, p - 27, p - 26)] if 200 <= p - 27 < 263 else []), True) for p in range(227, 300)]
)
ONE_SHOT = [([(0, 0, 300), (2, 0, 263)], False)]


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.fixture(scope="module")
def model_parts():
    raw = config_dict("micro")
    raw.update(head_dim=512, qk_rope_head_dim=64, index_head_dim=128)
    cfg = make_config(raw)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        csa, hca = tr.DeepseekV4CSACompressor(cfg), tr.DeepseekV4HCACompressor(cfg)
        for m in (csa, csa.indexer, hca):
            m.kv_proj.weight.copy_(_bf16(torch.randn(m.kv_proj.weight.shape, generator=g) * 0.2))
            m.gate_proj.weight.copy_(_bf16(torch.randn(m.gate_proj.weight.shape, generator=g) * 0.5))
            m.position_bias.copy_(torch.randn(m.position_bias.shape, generator=g))
            m.kv_norm.weight.copy_(1 + 0.3 * torch.randn(m.kv_norm.weight.shape, generator=g))
    x = {r: _bf16(torch.randn(n, HIDDEN, generator=g)) for r, n in LENS.items()}
    return cfg, csa, hca, x


def _freqs_cis(module) -> torch.Tensor:
    inv = module.rotary_emb.compress_inv_freq.float()
    ang = torch.arange(1024, dtype=torch.float32).unsqueeze(1) * inv
    return torch.polar(torch.ones_like(ang), ang)


def _setup(module, ratio: int) -> tuple[CompressorSetup, torch.Tensor]:
    d = module.kv_norm.weight.shape[0]
    pb = module.position_bias.detach().float()
    ape = torch.cat([pb[:, :d], pb[:, d:]], dim=0) if ratio == 4 else pb  # sglang's _apply_ape_hotfix layout
    w = torch.cat([module.kv_proj.weight, module.gate_proj.weight]).detach().float()
    return CompressorSetup(
        ratio, d, ape, module.kv_norm.weight.detach().float(), module.kv_norm.variance_epsilon, _freqs_cis(module)
    ), w


def _reference(cfg, csa, hca, x) -> dict[str, dict[int, torch.Tensor]]:
    """transformers' compressed entries per request: main c4 [T, 512], indexer c4 [T, 128], c128 [T, 512]."""
    out = {"c4": {}, "index": {}, "c128": {}}
    with torch.no_grad():
        for r, xr in x.items():
            s = xr.shape[0]
            ids = torch.arange(s).unsqueeze(0)
            cache = SimpleNamespace(layers=[tr.DeepseekV4CSACache(cfg)])
            csa(xr.unsqueeze(0), torch.randn(1, s, cfg.q_lora_rank), ids, cache, 0)
            out["c4"][r] = cache.layers[0].compressed_kv["compressor"][0]
            out["index"][r] = cache.layers[0].compressed_kv["indexer"][0]
            kv, _ = hca(xr.unsqueeze(0), None, ids, None, 0)
            out["c128"][r] = kv[0, 0]
    return out


def _kv_scores(w: torch.Tensor, x: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """sglang's linear_bf16_fp32(x, cat(wkv, wgate)): bf16 operands, fp32 result."""
    return {r: xr @ w.T for r, xr in x.items()}


CASES = [
    ("c4", 4, lambda csa, hca: csa),
    ("index", 4, lambda csa, hca: csa.indexer),
    ("c128", 128, lambda csa, hca: hca),
]


def test_schedule_covers_both_requests():
    ends = {r: 0 for r in LENS}
    for batch, _ in CHUNKED:
        for r, a, e in batch:
            assert a == ends[r]
            ends[r] = e
    assert ends == LENS


@pytest.mark.parametrize("name,ratio,pick", CASES, ids=[c[0] for c in CASES])
def test_compressor_matches_transformers(model_parts, name, ratio, pick):
    cfg, csa, hca, x = model_parts
    ref = _reference(cfg, csa, hca, x)[name]
    setup, w = _setup(pick(csa, hca), ratio)
    scores = _kv_scores(w, x)
    chunked = run(setup, scores, CHUNKED)
    one_shot = run(setup, scores, ONE_SHOT)
    for r, n in LENS.items():
        t = n // ratio
        assert ref[r].shape[0] == t
        want = ref[r] if name != "index" else hadamard_transform(ref[r])
        got32 = torch.stack([chunked.recorded[(r, j)] for j in range(t)])
        got32 = got32 if name != "index" else hadamard_transform(got32)
        amax = want.abs().amax(dim=-1, keepdim=True)
        fp32_err = ((got32 - want).abs() / amax).max().item()
        assert fp32_err < 2e-5, f"{name} req {r}: fp32 path off by {fp32_err:.2e} of the entry max"
        # Chunked + decode wrote exactly the bytes one-shot prefill wrote.
        entries = chunked.read_entries(r, t)
        assert torch.equal(entries, one_shot.read_entries(r, t)), f"{name} req {r}: chunked != one-shot bytes"
        tol = 2e-5 * amax
        if name == "index":
            deq = dequantize_chunks(entries)
            s = entries[:, 128:].contiguous().view(torch.float32)
            bound = 2**-4 * want.abs() + 2**-10 * s + tol
        else:
            deq = dequantize_kv_entries(entries)
            s = (entries[:, 576:583].to(torch.int32) << 23).view(torch.float32).repeat_interleave(64, dim=1)
            nope = want[:, :448]
            bound = (
                torch.cat(
                    [2**-8 * nope.abs() + 2**-4 * _bf16(nope).abs() + 2**-10 * s, 2**-8 * want[:, 448:].abs()], dim=1
                )
                + tol
            )
        err = (deq - want).abs()
        assert bool((err <= bound).all()), f"{name} req {r}: worst err/bound {(err / bound).max().item():.3f}"
        print(
            f"{name} req {r}: fp32 rel err {fp32_err:.2e}, fp8 max err/bound {(err / bound).max().item():.3f}, "
            f"max abs err {err.max().item():.3e}"
        )


def test_untouched_pool_bytes_stay(model_parts):
    """Only the entry bytes of closed windows change; every other byte (other slots, the pad byte) is kept."""
    cfg, csa, hca, x = model_parts
    setup, w = _setup(csa, 4)
    h = run(setup, _kv_scores(w, x), [])
    before = h.pool.clone()
    for batch, decode in ONE_SHOT:
        h.step(_kv_scores(w, x), batch, decode)
    changed = (h.pool != before).nonzero()
    locs = torch.cat([h.entry_loc(r, torch.arange(n // 4)) for r, n in LENS.items()])
    fmt = h.fmt
    allowed = fmt.flat_index(locs // 64, locs % 64)[:, :-1].reshape(-1)  # entry bytes without the pad byte
    flat_changed = changed[:, 0] * fmt.page_bytes + changed[:, 1]
    assert bool(torch.isin(flat_changed, allowed).all())
    assert flat_changed.numel() > 0.9 * allowed.numel()
