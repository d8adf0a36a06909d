"""Init from native DeepSeek-V4 weights: official and HF names, fp8 block scales, head/rank expansion."""

from __future__ import annotations

import pytest
import torch

from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.train.native_init import (
    NativeWeightError,
    NativeWeights,
    c4_layers_from_config,
    copy_native,
    dequantize_fp8,
)
from flashmemory.train.synthetic import TEACHER_DIMS, write_native_checkpoint


def test_c4_layers_from_config() -> None:
    assert c4_layers_from_config({"compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0], "num_hidden_layers": 7}) == [2, 4, 6]
    assert c4_layers_from_config({"layer_types": ["sliding_attention", "compressed_sparse_attention"]}) == [1]


def test_dequantize_fp8_blocks() -> None:
    w = torch.randn(200, 130)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = dequantize_fp8(w, scale)
    assert torch.equal(got[:128, :128], w[:128, :128]) and torch.equal(got[128:, 128:], w[128:, 128:] * 4)


def test_official_dir_with_fp8_roundtrips(tmp_path, teacher) -> None:
    write_native_checkpoint(tmp_path, teacher, fp8_wq_a=True)
    student = JointRetriever((0, 1), TEACHER_DIMS)
    notes = copy_native(student, NativeWeights(tmp_path))
    assert "model layer 4" in notes[1]
    for lid in (0, 1):
        a, b = student.layer(lid), teacher.layer(lid)
        assert torch.equal(a.wq_b.weight, b.wq_b.weight) and torch.equal(a.q_norm_weight, b.q_norm_weight)
        rel = (a.wq_a.weight - b.wq_a.weight).norm() / b.wq_a.weight.norm()
        assert 0 < rel < 0.05  # fp8 round trip: close, not identical


def test_hf_names_and_expansion(teacher) -> None:
    hf = {}
    for lid, mi in ((0, 2), (1, 4)):
        L = teacher.layer(lid)
        p = f"model.layers.{mi}.self_attn."
        hf[p + "q_a_proj.weight"] = L.wq_a.weight.detach()
        hf[p + "q_a_norm.weight"] = L.q_norm_weight.detach()
        hf[p + "compressor.indexer.q_b_proj.weight"] = L.wq_b.weight.detach()
        hf[p + "compressor.indexer.scorer.weights_proj.weight"] = L.weights_proj.weight.detach()
    nw = NativeWeights(hf)
    nw.cfg = {"compress_ratios": [0, 0, 4, 128, 4, 0]}
    big = RetrieverDims(hidden=64, rank=48, n_heads=12, head_dim=32, rope_dim=16)
    student = JointRetriever((0, 1), big)
    copy_native(student, nw)
    t, s = teacher.layer(1), student.layer(1)
    d = TEACHER_DIMS
    assert torch.equal(s.wq_a.weight[: d.rank], t.wq_a.weight)
    assert torch.equal(s.q_norm_weight[d.rank :], torch.ones(48 - d.rank))
    wq_b = s.wq_b.weight.view(12, 32, 48)
    assert torch.equal(wq_b[:8, :, :32], t.wq_b.weight.view(8, 32, 32))
    assert torch.equal(wq_b[:8, :, 32:], torch.zeros(8, 32, 16)) and wq_b[8:].abs().sum() > 0
    assert torch.equal(s.weights_proj.weight[:8], t.weights_proj.weight)
    with pytest.raises(NativeWeightError, match="only 3 c4 layers"):
        nw.cfg = {"compress_ratios": [0, 0, 4, 4, 4]}
        copy_native(JointRetriever((5,), big), nw)


def test_missing_key_is_named(teacher) -> None:
    nw = NativeWeights({"model.layers.2.self_attn.q_a_proj.weight": torch.zeros(32, 64)})
    nw.cfg = {"compress_ratios": [0, 0, 4]}
    with pytest.raises(NativeWeightError, match=r"no key for q_norm_weight of model layer 2"):
        copy_native(JointRetriever((0,), TEACHER_DIMS), nw)
