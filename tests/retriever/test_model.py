"""The retriever scorer against a float64 reference written here from the math (not from the package).

Reference: q = Hadamard(YaRN(wq_b(RMSNorm(wq_a x)))), w = weights_proj(x) D^-1/2 H^-1/2,
k = fp8 * scale, score = sigmoid(sum_h relu(q_h . k) w_h + offset).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashmemory.retriever.fp8 import dequantize_chunks, quantize_chunks
from flashmemory.retriever.model import JointRetriever, RetrieverDims, RetrieverLayer, relu_head_scores
from flashmemory.retriever.rope import RopeConfig

TOL = 1e-5


# ---------------------------------------------------------------- float64 reference, from the formulas
def ref_sylvester(d: int) -> torch.Tensor:
    """Sylvester Hadamard as a Kronecker power of [[1, 1], [1, -1]]."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(int(math.log2(d))):
        h = torch.kron(h, h2)
    return h


def ref_yarn_freqs(rope_dim: int, theta=160000.0, factor=16.0, orig=65536, beta_fast=32.0, beta_slow=1.0):
    half = rope_dim // 2
    base = [1.0 / theta ** (2 * i / rope_dim) for i in range(half)]
    corr = lambda r: rope_dim * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), half - 1)
    out = []
    for i, f in enumerate(base):
        r = 0.0 if i < low else 1.0 if i >= high else (i - low) / (high - low)
        out.append(f * (1 - r) + f / factor * r)
    return torch.tensor(out, dtype=torch.float64)


def ref_rope(q: torch.Tensor, pos: torch.Tensor, rope_dim: int, max_position: int = 1048576) -> torch.Tensor:
    """q [B, H, D] float64; rotate the last rope_dim dims as complex pairs (2i, 2i+1)."""
    p = pos.to(torch.float64).clamp(max=max_position - 1)
    ang = p[:, None] * ref_yarn_freqs(rope_dim)[None, :]  # [B, rope/2]
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]  # [B, 1, rope/2]
    z = torch.view_as_complex(q[..., -rope_dim:].contiguous().reshape(*q.shape[:-1], rope_dim // 2, 2))
    out = torch.view_as_real(z * rot).reshape(*q.shape[:-1], rope_dim)
    return torch.cat((q[..., :-rope_dim], out), -1)


def ref_keys(chunks: torch.Tensor) -> torch.Tensor:
    """[.., D+4] uint8 -> [.., D] float64 from the raw bytes."""
    d = chunks.shape[-1] - 4
    vals = chunks[..., :d].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
    scale = chunks[..., d:].contiguous().view(torch.float32).to(torch.float64)
    return vals * scale


def ref_logits(
    layer: RetrieverLayer, x: torch.Tensor, pos: torch.Tensor, keys64: torch.Tensor, offset: float = 0.0
) -> torch.Tensor:
    d = layer.dims
    wa, wb = layer.wq_a.weight.detach().double(), layer.wq_b.weight.detach().double()
    g, wp = layer.q_norm_weight.detach().double(), layer.weights_proj.weight.detach().double()
    x = x.double()
    ql = x @ wa.T
    ql = ql / torch.sqrt((ql**2).mean(-1, keepdim=True) + 1e-6) * g
    q = (ql @ wb.T).view(x.shape[0], d.n_heads, d.head_dim)
    q = ref_rope(q, pos, d.rope_dim, layer.rope.max_position)
    q = q @ (ref_sylvester(d.head_dim) / math.sqrt(d.head_dim))  # H symmetric: x H / sqrt(D)
    w = (x @ wp.T) * d.head_dim**-0.5 * d.n_heads**-0.5
    if keys64.dim() == 2:
        dots = torch.einsum("bhd,nd->bnh", q, keys64)
    else:
        dots = torch.einsum("bhd,bnd->bnh", q, keys64)
    return (dots.clamp_min(0) * w[:, None, :]).sum(-1) + offset


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| over finite entries."""
    m = torch.isfinite(ref)
    return ((got.double()[m] - ref[m]).abs().max() / ref[m].abs().max().clamp_min(1e-30)).item()


def make_layer(dims: RetrieverDims, seed: int, offset: float = 0.0) -> RetrieverLayer:
    torch.manual_seed(seed)
    layer = RetrieverLayer(dims, logit_offset=offset)
    with torch.no_grad():
        layer.q_norm_weight.uniform_(0.5, 1.5)  # not all ones, so the norm weight is exercised
    return layer


def make_chunks(n: int, d: int, seed: int, batch: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = n if batch is None else batch * n
    k = torch.randn(rows, d, generator=g) * torch.rand(rows, 1, generator=g) * 4  # varied per-chunk scales
    c = quantize_chunks(k)
    return c if batch is None else c.view(batch, n, d + 4)


SHAPES = [
    RetrieverDims(hidden=64, rank=32, n_heads=4, head_dim=16, rope_dim=8),
    RetrieverDims(hidden=256, rank=96, n_heads=16, head_dim=64, rope_dim=32),
    RetrieverDims(hidden=512, rank=256, n_heads=8, head_dim=128, rope_dim=64),
    RetrieverDims(),  # full size: hidden 4096, rank 2048, 128 heads x 128, rope 64
]
POSITIONS = [0, 1, 65535, 1048575, 3_000_000, 777]  # the last-but-one is past max_position: clamped


@pytest.mark.parametrize("dims", SHAPES, ids=lambda d: f"h{d.hidden}r{d.rank}H{d.n_heads}D{d.head_dim}")
def test_logits_match_float64_reference(dims: RetrieverDims) -> None:
    layer = make_layer(dims, seed=dims.hidden, offset=0.25)
    b = 3
    x = torch.randn(b, dims.hidden, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor(POSITIONS[:b] if dims.hidden != 4096 else POSITIONS[2 : 2 + b])
    chunks = make_chunks(40 if dims.hidden == 4096 else 97, dims.head_dim, seed=2)
    with torch.no_grad():
        got = layer.logits(x, pos, dequantize_chunks(chunks))
        scores = layer(x, pos, dequantize_chunks(chunks))
    ref = ref_logits(layer, x, pos, ref_keys(chunks), offset=0.25)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert rel_err(got, ref) <= TOL
    assert (scores.double() - torch.sigmoid(ref)).abs().max().item() <= 1e-6
    # Relu must actually clip something, or the test would not see a wrong relu.
    q, _ = layer.query(x, pos)
    assert (q.double() @ ref_keys(chunks).T < 0).any()


def test_batched_lengths_mask_columns_and_per_row_keys() -> None:
    dims = RetrieverDims(hidden=128, rank=64, n_heads=8, head_dim=32, rope_dim=16)
    layer = make_layer(dims, seed=7)
    b, n = 4, 50
    x = torch.randn(b, dims.hidden)
    pos = torch.tensor([5, 400, 70000, 1048575])
    lengths = torch.tensor([50, 17, 1, 0])
    chunks = make_chunks(n, dims.head_dim, seed=3, batch=b)
    keys = dequantize_chunks(chunks)  # [B, N, D]: each row its own history
    with torch.no_grad():
        scores = layer(x, pos, keys, lengths)
        logits = layer.logits(x, pos, keys, lengths)
    ref = ref_logits(layer, x, pos, ref_keys(chunks))
    col = torch.arange(n)[None, :]
    live = col < lengths[:, None]
    assert torch.all(scores[~live] == 0)
    assert torch.all(torch.isneginf(logits[~live]))
    assert rel_err(torch.where(live, logits, 0.0), torch.where(live, ref, 0.0)) <= TOL
    # Shared keys [N, D] give each row the same answer as per-row copies of them.
    shared = keys[0]
    with torch.no_grad():
        a = layer.logits(x, pos, shared)
        c = layer.logits(x, pos, shared.expand(b, n, -1).contiguous())
    assert rel_err(a, c.double()) <= TOL


def test_relu_head_scores_blocks_over_n(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashmemory.retriever.model as m

    q, w = torch.randn(2, 4, 16, dtype=torch.float32), torch.randn(2, 4)
    keys = torch.randn(37, 16)
    whole = relu_head_scores(q, w, keys)
    monkeypatch.setattr(m, "_SCORE_BLOCK", 5)  # many blocks with a ragged tail
    blocked = relu_head_scores(q, w, keys)
    blocked_b = relu_head_scores(q, w, keys.expand(2, 37, 16))
    ref = torch.einsum("bhd,nd->bnh", q.double(), keys.double()).clamp_min(0).mul(w.double()[:, None]).sum(-1)
    for t in (whole, blocked, blocked_b):
        assert rel_err(t, ref) <= TOL
    assert relu_head_scores(q, w, keys[:0]).shape == (2, 0)


def test_joint_retriever_keys_and_layers() -> None:
    dims = RetrieverDims(hidden=32, rank=16, n_heads=2, head_dim=16, rope_dim=8)
    model = JointRetriever([20, 10, 12], dims)
    assert model.layers == (10, 12, 20)
    keys = set(model.state_dict())
    assert {
        f"retrievers.l{i}.{k}"
        for i in (10, 12, 20)
        for k in ("wq_a.weight", "wq_b.weight", "q_norm_weight", "weights_proj.weight")
    } == keys
    with pytest.raises(KeyError, match="13"):
        model.layer(13)
    x = {i: torch.randn(2, 32) for i in model.layers}
    kv = {i: torch.randn(9, 16) for i in model.layers}
    out = model(x, torch.tensor([3, 4]), kv)
    for i in model.layers:
        torch.testing.assert_close(out[i], model.layer(i)(x[i], torch.tensor([3, 4]), kv[i]))
    with pytest.raises(KeyError, match="12"):
        model({10: x[10], 20: x[20]}, torch.tensor([3, 4]), kv)


def test_bad_shapes_raise() -> None:
    dims = RetrieverDims(hidden=32, rank=16, n_heads=2, head_dim=16, rope_dim=8)
    layer = RetrieverLayer(dims)
    with pytest.raises(ValueError, match="32"):
        layer.query(torch.randn(2, 31), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="power of two"):
        RetrieverDims(head_dim=96)
    with pytest.raises(ValueError, match="rope_dim"):
        RetrieverDims(head_dim=16, rope_dim=18)
    with pytest.raises(ValueError, match="rope_dim"):
        RetrieverLayer(dims, RopeConfig(rope_dim=4))


def test_reference_tells_wrong_variants_apart() -> None:
    """The tolerance is far below what a wrong RoPE layout, a missing Hadamard or eps would change."""
    dims = RetrieverDims(hidden=256, rank=96, n_heads=16, head_dim=64, rope_dim=32)
    layer = make_layer(dims, seed=11)
    x = torch.randn(2, dims.hidden)
    pos = torch.tensor([12345, 999999])
    chunks = make_chunks(64, dims.head_dim, seed=5)
    with torch.no_grad():
        got = layer.logits(x, pos, dequantize_chunks(chunks))
    assert rel_err(got, ref_logits(layer, x, pos, ref_keys(chunks))) <= TOL
    # Mutant: rotate the first rope_dim dims instead of the last ones.
    orig_rope = ref_rope
    try:
        globals()["ref_rope"] = lambda q, p, r, m=1048576: orig_rope(q.flip(-1), p, r, m).flip(-1)
        assert rel_err(got, ref_logits(layer, x, pos, ref_keys(chunks))) > 1e-3
    finally:
        globals()["ref_rope"] = orig_rope
    # Mutant: no Hadamard.
    orig_h = ref_sylvester
    try:
        globals()["ref_sylvester"] = lambda d: torch.eye(d, dtype=torch.float64) * math.sqrt(d)
        assert rel_err(got, ref_logits(layer, x, pos, ref_keys(chunks))) > 1e-3
    finally:
        globals()["ref_sylvester"] = orig_h
