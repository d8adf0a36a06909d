"""Training's output dir and failure modes: reruns, the lock, divergence, resume past the end,
file-system errors. Driven through `flashmemory.cli.main` where the exit code and the one line matter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flashmemory.cli import main
from flashmemory.errors import UserError
from flashmemory.outdir import DirLock, DirLockedError
from flashmemory.train import loop
from flashmemory.train.loop import BEST_F1, TrainConfig, Trainer
from flashmemory.train.samples import SampleConfig


def _cfg(synth: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data_config=str(synth / "data.json"),
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
        progress=False,
    )
    return TrainConfig(**(base | kw))


def _argv(synth: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data-config",
        str(synth / "data.json"),
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


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and not p.name.startswith(".")}


def test_rerun_into_a_used_dir_is_refused_and_overwrite_moves_the_old_run_aside(synth, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(_argv(synth, out)) == 0
    before = _snapshot(out)
    assert BEST_F1 in before and "metrics.jsonl" in before
    capsys.readouterr()
    assert main(_argv(synth, out, "--epochs", "2")) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"flashmemory train: error: --output-dir {out}: already holds a training run")
        and "--resume-from" in err
        and "--overwrite" in err
        and len(err.splitlines()) == 1
    )
    assert _snapshot(out) == before  # nothing overwritten, nothing appended
    assert main(_argv(synth, out, "--overwrite")) == 0
    assert "moved the earlier run's files" in capsys.readouterr().out
    aside = [p for p in out.iterdir() if p.is_dir() and p.name.startswith("previous-")]
    assert len(aside) == 1 and _snapshot(aside[0]) == before  # the old run, byte for byte
    vals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"val"' in x]
    assert len(vals) == 2  # only the new run's step-0 and epoch-0 validations


def test_training_stores_the_full_rope_length(synth, tmp_path) -> None:
    tr = Trainer(_cfg(synth, tmp_path / "r"))
    tr.fit()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "r" / BEST_F1), "pt") as f:
        assert json.loads(f.metadata()["rope"])["max_position"] == 1_048_576  # not max(dumped + 1, 131072)


def test_a_second_writer_is_locked_out(synth, tmp_path) -> None:
    first = Trainer(_cfg(synth, tmp_path / "run"))
    with pytest.raises(DirLockedError, match=f"pid {os.getpid()}"):
        Trainer(_cfg(synth, tmp_path / "run"))
    first.fit()  # releases the lock at its end
    Trainer(_cfg(synth, tmp_path / "run", overwrite=True)).close()
    with DirLock(tmp_path / "run"):
        with pytest.raises(DirLockedError):
            DirLock(tmp_path / "run")


def test_non_finite_loss_stops_training_with_no_nan_checkpoint(synth, tmp_path, monkeypatch, capsys) -> None:
    real, calls = loop.batch_loss, []

    def poisoned(*a, **kw):
        calls.append(1)
        loss = real(*a, **kw)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(loop, "batch_loss", poisoned)
    out = tmp_path / "nan"
    assert main(_argv(synth, out)) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("flashmemory train: error: training diverged at step 3: loss nan") and len(err.splitlines()) == 1
    )
    assert not list(out.glob("ckpt_joint_epoch*"))  # the epoch never finished
    from flashmemory.retriever.checkpoint import load_retriever

    load_retriever(out / BEST_F1)  # the step-0 best is still there and finite (load checks every value)
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    Trainer(_cfg(synth, out, overwrite=True)).close()  # the lock was released on the error


def test_resume_past_the_last_epoch_is_an_error(synth, tmp_path) -> None:
    tr = Trainer(_cfg(synth, tmp_path / "r", epochs=2))
    tr.fit()
    ck = tmp_path / "r" / "ckpt_joint_epoch001.pt"
    with pytest.raises(UserError, match=r"already finished epoch 2 of --epochs 1 .*greater than 2"):
        Trainer(_cfg(synth, tmp_path / "r", epochs=1, resume_from=str(ck)))
    with pytest.raises(UserError, match="already finished epoch 2 of --epochs 2"):
        Trainer(_cfg(synth, tmp_path / "r", epochs=2, resume_from=str(ck)))
    # Resuming epoch 0 of that run moves epoch 1 (and the bests it may have set) aside, then continues.
    re = Trainer(_cfg(synth, tmp_path / "r", epochs=2, resume_from=str(tmp_path / "r" / "ckpt_joint_epoch000.pt")))
    assert re.moved_aside is not None and (re.moved_aside / "ckpt_joint_epoch001.pt").is_file()
    re.close()


def test_output_dir_that_is_a_file_or_unwritable_or_full(synth, tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "f").write_text("not a dir")
    assert main(_argv(synth, tmp_path / "f")) == 2
    want = f"flashmemory train: error: --output-dir {tmp_path / 'f'}: exists and is not a directory\n"
    assert capsys.readouterr().err == want
    assert main(_argv(synth, tmp_path / "f" / "sub")) == 2
    assert "a parent of it is a file" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        assert main(_argv(synth, ro)) == 2
        assert "Permission denied" in capsys.readouterr().err

    def full(obj, f, *a, **kw):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "full"
    assert main(_argv(synth, out)) == 2
    err = capsys.readouterr().err
    assert "ckpt_joint_epoch000.pt: could not write the checkpoint" in err and "disk full?" in err
    assert len(err.splitlines()) == 1
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_debug_shows_the_traceback_instead_of_the_line(synth, tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        main(_argv(synth, tmp_path / "f", "--debug"))


def _refuse_worker(rank: int, port: int, synth: str, out_dir: str, out: dict) -> None:
    import torch.distributed as dist

    from flashmemory.train.ddp import DistInfo

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        Trainer(_cfg(Path(synth), Path(out_dir)), DistInfo(rank, 2, torch.device("cpu")))
        out[rank] = "constructed"
    except UserError as e:
        out[rank] = str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_ranks_stop_together_when_rank0_refuses_the_dir(synth, tmp_path) -> None:
    """Only rank 0 owns the output dir; when it refuses, the other ranks stop too instead of waiting forever."""
    import socket

    import torch.multiprocessing as mp

    Trainer(_cfg(synth, tmp_path / "used")).fit()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as mgr:
        out = mgr.dict()
        mp.spawn(_refuse_worker, args=(port, str(synth), str(tmp_path / "used"), out), nprocs=2, join=True)
        got = dict(out)
    assert "already holds a training run" in got[0] and "refused by rank 0" in got[1], got


@pytest.mark.parametrize(
    "flag, value, why",
    [
        ("--epochs", "0", ">= 1"),
        ("--lr", "0", "(0.0, 10.0]"),
        ("--lr", "nan", "(0.0, 10.0]"),
        ("--wd", "-1", "[0.0"),
        ("--threshold", "1.5", "[0.0, 1.0]"),
        ("--rope-dim", "7", "even"),
        ("--batch-size", "-2", ">= 1"),
        ("--label-interval", "0", ">= 1"),
        ("--sample-interval", "0", ">= 1"),
        ("--max-pos", "-3", ">= 1"),
    ],
)
def test_numeric_flags_are_range_checked(synth, tmp_path, capsys, flag, value, why) -> None:
    assert main(_argv(synth, tmp_path / "o", flag, value)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashmemory train: error: {flag} ") and why in err
    assert not (tmp_path / "o").exists()  # refused before anything was written
