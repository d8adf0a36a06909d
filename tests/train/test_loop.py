"""End-to-end CPU training on a synthetic dump: loss falls, validation runs, checkpoints load; resume."""

from __future__ import annotations

import json

import pytest
import torch

from flashmemory.retriever.checkpoint import load_retriever
from flashmemory.train.loop import BEST_F1, BEST_RK, TrainConfig, Trainer
from flashmemory.train.samples import SampleConfig


def _cfg(synth, out, config="data.json", **kw) -> TrainConfig:
    base = dict(
        data_config=str(synth / config),
        output_dir=str(out),
        no_pretrain=True,
        joint_layers=(0, 1),
        n_heads=8,
        q_lora_rank=32,
        lr=3e-3,
        epochs=1,
        batch_size=8,
        sample=SampleConfig(neg_ratio=3.0),
        log_interval=5,
        seed=3,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_one_epoch_trains_and_writes_loadable_checkpoints(synth, tmp_path) -> None:
    tr = Trainer(_cfg(synth, tmp_path / "run", config="fit.json", lr=1e-2))
    s = tr.fit()
    losses = s["losses"]
    k = max(3, len(losses) // 4)
    assert sum(losses[-k:]) / k < 0.9 * sum(losses[:k]) / k, losses
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [x for x in lines if x["kind"] == "val"]
    assert len(vals) == 2 and any(x["kind"] == "train" for x in lines)  # step-0 + end of epoch
    for name in ("max", "mean"):
        for key in ("precision", "recall", "f1", "auc", "resident_frac", "r@128", "r@512", "r@1024"):
            assert key in vals[-1][name]
    assert set(vals[-1]["layers"]) == {"0", "1"}
    assert vals[-1]["max"]["auc"] > vals[0]["max"]["auc"]
    for ck in (BEST_F1, BEST_RK):
        m = load_retriever(tmp_path / "run" / ck)
        assert m.layers == (0, 1) and m.dims.n_heads == 8
        doc_keys = torch.randn(10, 32)
        out = m({0: torch.randn(2, 64), 1: torch.randn(2, 64)}, torch.tensor([300, 301]), {0: doc_keys, 1: doc_keys})
        assert out[0].shape == (2, 10) and bool(((out[0] >= 0) & (out[0] <= 1)).all())
    ep = torch.load(tmp_path / "run" / "ckpt_joint_epoch000.pt", weights_only=True)
    assert ep["step"] == tr.step == tr.steps_per_epoch and "exp_avg" in ep["optimizer"]["state"][0]
    assert load_retriever(tmp_path / "run" / "ckpt_joint_epoch000.pt").layers == (0, 1)


def test_resume_continues_with_the_same_optimizer_state(synth, tmp_path) -> None:
    full = Trainer(_cfg(synth, tmp_path / "full", epochs=2))
    full.fit()
    first = Trainer(_cfg(synth, tmp_path / "part", epochs=2))
    first.fit(max_epochs=1)
    ck = tmp_path / "part" / "ckpt_joint_epoch000.pt"
    resumed = Trainer(_cfg(synth, tmp_path / "part", epochs=2, resume_from=str(ck)))
    assert resumed.step == first.step and resumed.start_epoch == 1
    saved, loaded = first.opt.state_dict(), resumed.opt.state_dict()
    for i, st in saved["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[name], loaded["state"][i][name])
    assert resumed.sched.last_epoch == first.sched.last_epoch
    resumed.fit()
    assert resumed.step == full.step
    for (k, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), k


def test_resume_rejects_a_non_epoch_checkpoint(synth, tmp_path) -> None:
    tr = Trainer(_cfg(synth, tmp_path / "a"))
    tr.fit()
    from flashmemory.retriever.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="resume-from"):
        Trainer(_cfg(synth, tmp_path / "b", resume_from=str(tmp_path / "a" / BEST_F1)))


def test_native_init_from_teacher_beats_random(synth, teacher, tmp_path) -> None:
    """With the teacher as 'native' weights, the step-0 validation is already good."""
    from flashmemory.train.synthetic import write_native_checkpoint

    wd = write_native_checkpoint(tmp_path / "native", teacher)
    tr = Trainer(_cfg(synth, tmp_path / "n", no_pretrain=False, weight_dir=str(wd)))
    rnd = Trainer(_cfg(synth, tmp_path / "r"))
    a, b = tr.validator(tr.model), rnd.validator(rnd.model)
    assert a["max"]["auc"] > 0.7 > 0.6 > b["max"]["auc"]
