"""`flashmemory eval` scores held-out documents by default and prints which split it scored."""

from __future__ import annotations

import json
from pathlib import Path

from flashmemory.cli import main
from flashmemory.eval.split import heldout_paths, seen_doc_ids
from flashmemory.retriever.checkpoint import save_retriever
from flashmemory.train.data_config import DataSpec, trained_on_meta


def test_seen_and_heldout(tmp_path):
    meta = {"trained_on": trained_on_meta([DataSpec(tmp_path, (0, 1))], [DataSpec(tmp_path, (2,))])}
    assert seen_doc_ids(meta, tmp_path) == {0, 1, 2}
    assert seen_doc_ids(meta, tmp_path / "other") == set()
    assert seen_doc_ids({}, tmp_path) is None
    assert seen_doc_ids({"trained_on": trained_on_meta([DataSpec(tmp_path, None)], [])}, tmp_path) == {-1}
    paths = [Path(f"doc_{i}.npz") for i in range(5)]
    keep, line = heldout_paths(paths, meta, tmp_path, all_docs=False)
    assert [p.name for p in keep] == ["doc_3.npz", "doc_4.npz"] and "held-out, 2 of 5" in line
    keep, line = heldout_paths(paths, meta, tmp_path, all_docs=True)
    assert len(keep) == 5 and "training documents included" in line
    keep, line = heldout_paths(paths, {}, tmp_path, all_docs=False)
    assert len(keep) == 5 and "records no training documents" in line


def test_eval_cli_default_is_heldout(synth, teacher, tmp_path, capsys):
    dump = synth / "train"
    meta = {"trained_on": trained_on_meta([DataSpec(dump, (0, 1, 2))], [])}
    ck = save_retriever(teacher, tmp_path / "t.safetensors", meta)
    assert main(["eval", "--checkpoint", str(ck), "--dump", str(dump), "--stride", "8", "--budgets", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "split: held-out, 1 of 4 docs" in out and "doc ids [3]" in out
    assert (
        main(["eval", "--checkpoint", str(ck), "--dump", str(dump), "--stride", "8", "--budgets", "0.25", "--all-docs"])
        == 0
    )
    assert "split: all 4 docs" in capsys.readouterr().out
    # every doc seen: a clear error, not an empty table
    ck2 = save_retriever(
        teacher, tmp_path / "t2.safetensors", {"trained_on": trained_on_meta([DataSpec(dump, None)], [])}
    )
    assert main(["eval", "--checkpoint", str(ck2), "--dump", str(dump)]) == 2
    assert "no documents to score" in capsys.readouterr().err


def test_eval_cli_data_config_split(synth, teacher, tmp_path, capsys):
    ck = save_retriever(teacher, tmp_path / "t.safetensors")
    cfg = tmp_path / "d.json"
    cfg.write_text(
        json.dumps(
            {
                "train": [{"data_dir": str(synth / "train"), "doc_ids": [0, 1]}],
                "val": [{"data_dir": str(synth / "val")}],
                "test": [{"data_dir": str(synth / "train"), "doc_ids": [2, 3]}],
            }
        )
    )
    assert main(["eval", "--checkpoint", str(ck), "--data-config", str(cfg), "--stride", "8", "--budgets", "0.25"]) == 0
    assert f"split: test of {cfg}, 2 docs" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(ck), "--data-config", str(cfg), "--dump", str(synth / "train")]) == 2
