"""`flashmemory verify`: native mode against a teacher-made dump, checkpoint mode against float64."""

from __future__ import annotations

import torch

from flashmemory.cli import main
from flashmemory.retriever.checkpoint import save_retriever
from flashmemory.train.synthetic import make_teacher, write_native_checkpoint
from flashmemory.train.verify import pearson, reference_logits, topk_overlap


def test_native_mode_passes_with_the_right_weights_and_fails_otherwise(synth, teacher, tmp_path, capsys) -> None:
    good = write_native_checkpoint(tmp_path / "good", teacher, fp8_wq_a=True)
    (good / "config.json").write_text((good / "config.json").read_text()[:-1] + ', "qk_rope_head_dim": 16}')
    assert main(["verify", "--dump", str(synth / "val"), "--weight-dir", str(good)]) == 0
    assert "PASS" in capsys.readouterr().out
    bad = write_native_checkpoint(tmp_path / "bad", make_teacher(seed=5))
    assert main(["verify", "--dump", str(synth / "val"), "--weight-dir", str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_checkpoint_mode(synth, teacher, tmp_path, capsys) -> None:
    ck = save_retriever(teacher, tmp_path / "t.safetensors")
    assert main(["verify", "--dump", str(synth / "val"), "--checkpoint", str(ck), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "max relative error" in out
    assert main(["verify", "--dump", str(synth / "val")]) == 2  # no mode given


def test_reference_is_independent_of_the_model_path(teacher) -> None:
    layer = teacher.layer(0)
    g = torch.Generator().manual_seed(1)
    h, pos, keys = torch.randn(2, 64, generator=g), torch.tensor([5, 70000]), torch.randn(30, 32, generator=g)
    sd = {
        k: layer.get_parameter(k).detach()
        for k in ("wq_a.weight", "wq_b.weight", "q_norm_weight", "weights_proj.weight")
    }
    ref = reference_logits(sd, teacher.rope, h, pos, keys, 8, 32)
    got = layer.logits(h, pos, keys)
    assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-5)
    assert pearson(got[0], ref[0]) > 0.9999 and topk_overlap(got[0], ref[0].float(), 10) == 1.0
    # A different position (RoPE) changes the reference: the comparison is not vacuous.
    assert not torch.allclose(reference_logits(sd, teacher.rope, h, pos + 1, keys, 8, 32), ref, atol=1e-5)
