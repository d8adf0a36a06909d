"""The equivalence helpers without a server: sglang meta_info parsing, per-step comparison, the judge's bound
and greedy rule on synthetic rows, and the fp8-KV simulation hooks on the serving-tiny geometry."""

from __future__ import annotations

import math

import pytest
import torch

from tests.sglang.equivalence import (
    MULTIPLE,
    compare,
    fp8_kv_simulation,
    judge,
    logprob_rows,
    reference_logprobs,
    summary,
)

V = 8


def _meta(rows: torch.Tensor) -> dict:
    """sglang's shape: one list of (logprob, id, text) per step, best first."""
    out = []
    for row in rows:
        order = row.argsort(descending=True).tolist()
        out.append([[float(row[t]), t, None] for t in order])
    return {"output_top_logprobs": out}


def _rows(steps: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(steps, V, generator=g) * 2, dim=-1)


def test_logprob_rows_round_trip():
    rows = _rows()
    got = logprob_rows(_meta(rows), V)
    assert got.dtype == torch.float32 and got.shape == (3, V)
    assert torch.equal(got, rows)


@pytest.mark.parametrize(
    "meta, match",
    [
        ({}, "missing or empty"),
        ({"output_top_logprobs": []}, "missing or empty"),
        ({"output_top_logprobs": [[[-0.1, 0, None]]]}, f"{V - 1} .* missing"),
        ({"output_top_logprobs": [[[-0.1, V, None]]]}, "outside"),
        ({"output_top_logprobs": [[[float("nan"), 0, None]]]}, "non-finite"),
        ({"output_top_logprobs": [[[None, 0, None]]]}, "non-finite"),
    ],
)
def test_logprob_rows_refuses(meta, match):
    with pytest.raises(ValueError, match=match):
        logprob_rows(meta, V)


def test_compare_on_known_rows():
    ref = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0, 0.0], [0.0, 0.5, 2.0, 0.0]]), dim=-1)
    a = ref.clone()
    a[0, 3] += 0.25  # step 0: one entry off, same argmax
    a[1, 1] += 2.0  # step 1: argmax moves to id 1
    d = compare(a, ref)
    assert d[0].max_abs == pytest.approx(0.25) and d[0].agree
    assert d[0].ref_margin == pytest.approx(2.0)
    assert d[1].max_abs == pytest.approx(2.0) and not d[1].agree
    assert d[1].ref_margin == pytest.approx(1.5)
    s = summary(d)
    assert s["max_abs"] == pytest.approx(2.0) and s["agree"] == 1 and s["steps"] == 2
    with pytest.raises(ValueError, match="equal"):
        compare(a, ref[:1])


def _noisy(ref: torch.Tensor, eps: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ref + eps * (2 * torch.rand(ref.shape, generator=g) - 1)


def test_judge_bound_and_greedy_rule():
    ref = _rows(4, seed=1)
    fp8, bf16 = _noisy(ref, 0.03, 2), _noisy(ref, 0.01, 3)
    noise = max(max(d.max_abs for d in compare(fp8, ref)), max(d.max_abs for d in compare(bf16, ref)))
    top = ref.argmax(-1).tolist()

    ok = judge(_noisy(ref, 1.5 * noise, 4), top, ref, fp8, bf16)
    assert ok.failures == [] and ok.bound == pytest.approx(MULTIPLE * noise)
    margins = [d.ref_margin for d in ok.sglang]
    assert ok.greedy_checked == [i for i, m in enumerate(margins) if m > 2 * ok.noise[i]] and ok.greedy_checked

    far = _noisy(ref, 1.5 * noise, 4)
    far[1, 0] += 3 * noise  # one entry beyond 2 x noise (and beyond the bound)
    bad = judge(far, far.argmax(-1).tolist(), ref, fp8, bf16)
    assert len(bad.failures) >= 1 and "exceeds" in bad.failures[0] and "step 1" in bad.failures[0]


def test_judge_greedy_only_where_the_margin_clears_the_noise():
    ref = torch.log_softmax(torch.tensor([[4.0, 0.0, 0.0, 0.0], [1.0, 0.99, 0.0, 0.0]]), dim=-1)
    fp8, bf16 = _noisy(ref, 0.02, 5), _noisy(ref, 0.02, 6)
    v = judge(ref.clone(), [0, 1], ref, fp8, bf16)  # step 1: a near-tie (margin 0.01), id 1 emitted
    assert v.greedy_checked == [0]
    assert v.failures == ["step 1: sglang emitted 1, not a maximiser of its own log-probs"]
    sg = ref.clone()
    sg[1, 1] = sg[1, 0]  # now a tie in sglang's own row: 1 is a maximiser
    assert judge(sg, [0, 1], ref, fp8, bf16).failures == []
    sg[0] = ref[0].flip(0)  # step 0 (margin 4 > 2 noise): sglang picks id 3
    v = judge(sg, [3, 1], ref, fp8, bf16)
    assert any(f.startswith("step 0: sglang emitted 3, reference argmax 0") for f in v.failures)
    with pytest.raises(ValueError, match="tokens"):
        judge(ref, [0], ref, fp8, bf16)


@pytest.fixture(scope="module")
def serving_geometry():
    """The serving-tiny architecture (seed 0, transformers' default init) in memory, fp32."""
    from flashmemory.hf.models import build_random, make_config
    from flashmemory.hf.serving_model import serving_config

    raw = serving_config()
    raw["initializer_range"] = 0.02
    return build_random(make_config(raw, "serving-tiny"), seed=0, dtype=torch.bfloat16).float()


def test_fp8_simulation_hooks_every_512_wide_kv_entry(serving_geometry):
    from flashmemory.sglang.cpu.ops.stores import dequantize_kv_entries, quantize_kv_entries

    model = serving_geometry
    names = [n for n, m in model.named_modules() if n.endswith("kv_norm")]
    wide = [n for n in names if dict(model.named_modules())[n].weight.shape[0] == 512]
    # 6 attention kv_norms + the compressors of layers 1-4 (c4, c128, c4, c128); the indexers' 128-wide ones not.
    assert len(wide) == 10 and len(names) == 12

    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        return lambda _m, _i, out: seen.setdefault(name, []).append(out.detach().clone())

    target = dict(model.named_modules())["model.layers.1.self_attn.compressor.kv_norm"]
    before = target.register_forward_hook(keep("raw"))
    ids = list(range(30, 62))
    try:
        with fp8_kv_simulation(model) as n_hooks:
            after = target.register_forward_hook(keep("sim"))
            try:
                sim = reference_logprobs(model, ids[:-4], ids[-4:])
            finally:
                after.remove()
    finally:
        before.remove()
    assert n_hooks == 10
    raw = seen["raw"][0].reshape(-1, 512)
    got = seen["sim"][0].reshape(-1, 512)
    want = dequantize_kv_entries(quantize_kv_entries(raw, round_nope_to_bf16=True))
    assert torch.equal(got[:, :448], want[:, :448])  # nope: the 584-B codec
    assert torch.equal(got[:, 448:], raw[:, 448:].bfloat16().float())  # rope: bf16
    assert not torch.equal(got, raw)
    assert all(not m._forward_hooks for m in model.modules())  # every hook removed on exit

    plain = reference_logprobs(model, ids[:-4], ids[-4:])
    assert plain.shape == (4, 1024) and torch.isfinite(plain).all()
    assert torch.allclose(plain.exp().sum(-1), torch.ones(4), atol=1e-4)
    d = max(x.max_abs for x in compare(sim, plain))
    assert 0 < d < 0.5, d  # a perturbation, not a different model
    b = max(x.max_abs for x in compare(reference_logprobs(model, ids[:-4], ids[-4:], bf16=True), plain))
    assert 0 < b < 0.5 and math.isfinite(b), b
    with pytest.raises(ValueError, match="empty"):
        reference_logprobs(model, ids, [])
