"""The held-out probe's training findings: each was a traceback or a silently wrong run.

Every test names the README "Errors and data safety" promise it protects."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashmemory.cli import main
from flashmemory.train.loop import BEST_F1, BEST_RK, TrainConfig, Trainer
from flashmemory.train.samples import SampleConfig


def _argv(cfg: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data-config",
        str(cfg),
        "--output-dir",
        str(out),
        "--no-pretrain",
        "--joint-layers",
        "0,1",
        "--n-heads",
        "8",
        "--q-lora-rank",
        "32",
        "--epochs",
        "1",
        "--no-progress",
        "--device",
        "cpu",
        *extra,
    ]


def _cfg(synth: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data_config=str(synth / "data.json"),
        output_dir=str(out),
        no_pretrain=True,
        joint_layers=(0, 1),
        n_heads=8,
        q_lora_rank=32,
        lr=3e-3,
        epochs=3,
        batch_size=8,
        sample=SampleConfig(neg_ratio=3.0),
        log_interval=5,
        seed=3,
        progress=False,
    )
    return TrainConfig(**(base | kw))


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """A one-document dump from a model of twice the synthetic hidden size."""
    from flashmemory.train.synthetic import TEACHER_DIMS, make_teacher, write_synthetic_dump

    root = tmp_path_factory.mktemp("wide")
    t = make_teacher(layers=(0, 1), dims=replace(TEACHER_DIMS, hidden=2 * TEACHER_DIMS.hidden), seed=1)
    write_synthetic_dump(root / "d", t, n_docs=1, prompt_len=64, n_tokens=16, seed=5)
    return root / "d"


@pytest.mark.parametrize("split", ["train", "val"])
def test_documents_of_two_hidden_sizes_are_named(synth, wide, tmp_path, capsys, split) -> None:
    """Was `RuntimeError: stack expects each tensor to be equal size` mid-epoch (train) or a shape error in the
    first validation (val). Promise: one line naming the file, non-zero exit, nothing written."""
    data = {"train": [str(synth / "train")], "val": [{"data_dir": str(synth / "val"), "doc_ids": [0]}]}
    data[split] = data[split] + [str(wide)]
    cfg = tmp_path / "mixed.json"
    cfg.write_text(json.dumps(data))
    assert main(_argv(cfg, tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashmemory train: error: ") and len(err.splitlines()) == 1, err
    assert str(wide) in err and "hidden size 128" in err and "has 64" in err and "same model" in err, err
    assert not (tmp_path / "o").exists()


def test_device_cuda_without_a_gpu_is_one_line(synth, tmp_path, capsys, monkeypatch) -> None:
    """Was a torch traceback ("Torch not compiled with CUDA enabled" / "no CUDA GPUs"). Promise: a bad flag is
    one line naming it, before any data is read."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev, why in (("cuda", "torch sees no CUDA GPU here"), ("cuda:0", "no CUDA GPU"), ("gpu", "not a torch device")):
        assert main(_argv(synth / "data.json", tmp_path / "o", "--device", dev)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"flashmemory train: error: --device {dev}") and why in err, err
        assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_neg_ratio_nan_or_inf_is_refused_where_it_is_read(synth, tmp_path, capsys, value) -> None:
    """--neg-ratio nan reached `int(round(nan * n))` in the first batch: `ValueError: cannot convert float NaN to
    integer` (inf: OverflowError). Promises: every numeric input is range-checked where it is read; non-finite
    values are caught where they enter."""
    assert main(_argv(synth / "data.json", tmp_path / "o", "--neg-ratio", value)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashmemory train: error: --neg-ratio {float(value)}: must lie in [0, 1e+06]"), err
    assert not (tmp_path / "o").exists()


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _best_meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata())


def test_resume_after_a_kill_logs_each_step_once_and_keeps_bests_of_this_run(synth, tmp_path, capsys) -> None:
    """Killed in epoch 2 after its validation (records and maybe a best file written) but before its epoch
    checkpoint, then `--resume-from ckpt_joint_epoch001.pt`: metrics.jsonl held epoch 2 twice. Promises: nothing
    deleted (the old metrics.jsonl is moved aside whole); the best checkpoints are those of a validation the
    run's metrics.jsonl records, with that score."""
    out = tmp_path / "run"
    Trainer(_cfg(synth, out)).fit()
    (out / "ckpt_joint_epoch002.pt").unlink()  # the kill: epoch 2's checkpoint was never written
    before = (out / "metrics.jsonl").read_text()
    tr = Trainer(_cfg(synth, out, resume_from=str(out / "ckpt_joint_epoch001.pt")))
    assert tr.moved_aside is not None and (tr.moved_aside / "metrics.jsonl").read_text() == before
    assert any("kept the records up to step" in n for n in tr.resume_notes)
    tr.fit()
    recs = _records(out)
    keys = [(r["kind"], r["step"], r["epoch"]) for r in recs]
    assert len(keys) == len(set(keys)), keys  # each step logged once
    assert sorted({r["epoch"] for r in recs if r["kind"] == "val"}) == [-1, 0, 1, 2]
    vals = {r["step"]: r for r in recs if r["kind"] == "val"}
    for name, key, metric in ((BEST_F1, "ens_f1", "f1"), (BEST_RK, "ens_r@512", "r@512")):
        meta = _best_meta(out / name)
        rec = vals[int(meta["step"])]  # chosen by a validation this run records ...
        assert float(meta[key]) == rec["max"][metric]  # ... with that score ...
        assert float(meta[key]) == max(v["max"][metric] for v in vals.values())  # ... the best of them


@pytest.mark.parametrize("same_dir", [True, False])
def test_a_resumed_run_always_ends_with_its_best_checkpoints(synth, tmp_path, capsys, same_dir) -> None:
    """`--resume-from` moved the best files aside with the later epochs and never rewrote them when the restored
    best score was not beaten, so the README's `eval --checkpoint .../ckpt_joint_best_ens_f1.safetensors` found
    nothing (a resume into a fresh dir had the same gap). A learning rate of 1e-12 leaves the weights, and so
    every validation score, unchanged: the restored best is never beaten. Promise: nothing deleted; a run
    ends with the files the README's eval and serve commands read."""
    out = tmp_path / "run"
    assert main(_argv(synth / "data.json", out, "--epochs", "2", "--lr", "1e-12")) == 0
    assert _best_meta(out / BEST_F1)["step"] == "0"  # step 0 was never beaten
    target = out if same_dir else tmp_path / "other"
    capsys.readouterr()
    assert (
        main(
            _argv(
                synth / "data.json",
                target,
                "--epochs",
                "2",
                "--lr",
                "1e-12",
                "--resume-from",
                str(out / "ckpt_joint_epoch000.pt"),
            )
        )
        == 0
    )
    printed = capsys.readouterr().out
    for name in (BEST_F1, BEST_RK):
        assert (target / name).is_file(), (name, sorted(p.name for p in target.iterdir()))
    if same_dir:  # the step-0 bests belong to the resumed run: kept, not moved aside
        assert _best_meta(out / BEST_F1)["step"] == "0"
        aside = [p for p in out.iterdir() if p.name.startswith("previous-")]
        assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == [
            "ckpt_joint_epoch001.pt",
            "metrics.jsonl",
        ]
    else:  # nothing to keep there: the resumed run's validation writes them, and says so
        assert "note: " in printed and "the next validation writes it" in printed


@pytest.mark.parametrize("value", [str(2**64), "-1"])
def test_a_seed_torch_cannot_take_names_the_flag(synth, tmp_path, capsys, value) -> None:
    """--seed 2**64 was "Overflow when unpacking long long" (torch's words, no flag). Promise: every numeric input
    is range-checked where it is read, and the error names the flag."""
    assert main(_argv(synth / "data.json", tmp_path / "o", "--seed", value)) == 2
    err = capsys.readouterr().err
    assert err == f"flashmemory train: error: --seed {value}: must lie in [0, 2**63)\n", err


@pytest.mark.parametrize("field, value", [("step", float("nan")), ("epoch", float("inf")), ("best", {"f1": "0.5"})])
def test_a_resume_checkpoint_with_a_nan_step_is_named(synth, tmp_path, capsys, field, value) -> None:
    """A NaN in an epoch checkpoint's progress fields reached `int()` ("cannot convert float NaN to integer",
    naming neither the file nor the field). Promises: non-finite values are caught where they enter; one line
    naming the file and the field."""
    out = tmp_path / "r"
    Trainer(_cfg(synth, out, epochs=1)).fit()
    obj = torch.load(str(out / "ckpt_joint_epoch000.pt"), weights_only=True)
    obj[field] = value
    bad = tmp_path / "bad.pt"
    torch.save(obj, bad)
    assert main(_argv(synth / "data.json", tmp_path / "o", "--epochs", "3", "--resume-from", str(bad))) == 2
    err = capsys.readouterr().err
    key = "best.f1" if field == "best" else field
    assert err.startswith(f"flashmemory train: error: --resume-from {bad}: '{key}' is "), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()
