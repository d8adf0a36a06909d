"""End to end on a REAL micro dump (flashmemory dump, hf backend, micro model): native verify passes,
1-epoch CPU training lowers the loss, the best checkpoint loads and scores, eval prints its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashmemory.cli import main
from flashmemory.retriever.checkpoint import load_retriever
from flashmemory.train.loop import BEST_F1, TrainConfig, Trainer
from flashmemory.train.samples import SampleConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "data_generation" / "example_data" / "tiny_chat.jsonl"


@pytest.mark.slow
def test_micro_dump_train_verify_eval(tmp_path, capsys) -> None:
    if not EXAMPLE.is_file():
        pytest.skip(f"{EXAMPLE} missing")
    dump = tmp_path / "dump"
    assert (
        main(
            [
                "dump",
                "--input",
                str(EXAMPLE),
                "--output-dir",
                str(dump),
                "--model",
                "micro",
                "--max-tokens",
                "24",
                "--n-samples",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert main(["verify", "--dump", str(dump), "--model", "micro"]) == 0
    assert "PASS" in capsys.readouterr().out
    cfg = tmp_path / "micro.json"
    cfg.write_text(
        json.dumps({"train": [{"data_dir": "dump", "doc_ids": [0, 1]}], "val": [{"data_dir": "dump", "doc_ids": [1]}]})
    )
    tr = Trainer(
        TrainConfig(
            data_config=str(cfg),
            output_dir=str(tmp_path / "run"),
            no_pretrain=True,
            n_heads=16,
            q_lora_rank=64,
            lr=1e-2,
            epochs=1,
            batch_size=4,
            log_interval=5,
            sample=SampleConfig(neg_ratio=3.0),
        )
    )
    assert tr.layers == (1, 2, 3)  # micro has 4 c4 layers; the dump keeps the last three
    losses = tr.fit()["losses"]
    k = max(2, len(losses) // 4)
    assert sum(losses[-k:]) / k < sum(losses[:k]) / k
    model = load_retriever(tmp_path / "run" / BEST_F1)
    assert model.layers == (1, 2, 3)
    # the checkpoint records its training documents: eval refuses to score only those unless asked
    assert main(["eval", "--checkpoint", str(tmp_path / "run" / BEST_F1), "--dump", str(dump), "--stride", "8"]) == 2
    assert "no documents to score" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(tmp_path / "run" / BEST_F1),
                "--dump",
                str(dump),
                "--stride",
                "8",
                "--all-docs",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "split: all" in out and "oracle" in out and "fm@thr" in out
