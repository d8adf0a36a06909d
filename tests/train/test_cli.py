"""`flashmemory train` CLI: help text and clear errors for bad inputs (exit code 2, nothing trained)."""

from __future__ import annotations

import json

import pytest

from flashmemory.cli import main


def test_help_lists_upstream_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--data-config",
        "--resume-from",
        "--weight-dir",
        "--no-pretrain",
        "--joint-layers",
        "--n-heads",
        "--q-lora-rank",
        "--focal-loss",
        "--neg-ratio",
        "--weighted-loss",
        "--label-interval",
        "--max-pos",
        "--sample-interval",
        "--patience-vals",
        "--val-every-steps",
        "--bf16",
        "--num-workers",
    ):
        assert flag in out


def test_missing_data_dir_is_a_clear_error(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train": [{"data_dir": "gone"}], "val": [{"data_dir": "gone"}]}))
    assert main(["train", "--data-config", str(cfg), "--no-pretrain", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "train[0]: data_dir 'gone'" in err and str(tmp_path / "gone") in err
    assert not (tmp_path / "o").exists()


def test_missing_layer_and_weights_are_named(synth, tmp_path, capsys) -> None:
    args = [
        "train",
        "--data-config",
        str(synth / "data.json"),
        "--output-dir",
        str(tmp_path / "o"),
        "--n-heads",
        "4",
        "--q-lora-rank",
        "16",
    ]
    assert main(args + ["--no-pretrain", "--joint-layers", "0,7"]) == 2
    assert "--joint-layers [7]" in capsys.readouterr().err
    assert main(args + ["--weight-dir", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err
