import json

import pytest

from flashmemory.tiny.train import TrainTinyConfig, length_at, lr_at, progress_at, train_tiny


def test_schedule():
    cfg = TrainTinyConfig(steps=100, time_budget_s=10, lengths=(128, 256, 512), length_until=(0.2, 0.5), warmup=10)
    assert progress_at(10, 0.0, cfg) == 0.1 and progress_at(10, 5.0, cfg) == 0.5
    assert [length_at(p, cfg) for p in (0.0, 0.19, 0.2, 0.49, 0.5, 1.0)] == [128, 128, 256, 256, 512, 512]
    assert lr_at(0, 0.0, cfg) == pytest.approx(cfg.lr / 10)
    assert lr_at(50, 1.0, cfg) == pytest.approx(cfg.lr * cfg.min_lr_frac)
    with pytest.raises(ValueError, match="length-until"):
        TrainTinyConfig(lengths=(128, 256), length_until=())
    with pytest.raises(ValueError, match="tasks"):
        TrainTinyConfig(tasks=("cwe",))


def test_train_logs_checkpoints_and_resumes(tmp_path):
    kw = dict(
        out_dir=str(tmp_path),
        steps=2,
        tokens_per_step=256,
        lengths=(128,),
        length_until=(),
        workers=0,
        eval_every=2,
        eval_docs=3,
        log_every=1,
        progress=False,
        tasks=("niah_single",),
        warmup=1,
    )
    s = train_tiny(TrainTinyConfig(**kw), log=lambda *_: None)
    assert s["step"] == 2 and 0.0 <= s["acc"] <= 1.0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2]
    assert all(x["loss"] > 0 and x["kl"] >= 0 for x in lines if "loss" in x)
    assert (tmp_path / "model" / "model.safetensors").is_file() and (tmp_path / "trainer.pt").is_file()
    s = train_tiny(TrainTinyConfig(**{**kw, "steps": 3}), log=lambda *_: None)
    assert s["step"] == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3]
    with pytest.raises(ValueError, match="same --seed"):
        train_tiny(TrainTinyConfig(**{**kw, "steps": 4, "seed": 1}), log=lambda *_: None)
