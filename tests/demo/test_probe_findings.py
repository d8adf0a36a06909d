"""`flashmemory eval quality`'s edges: a resumed run keys on the retriever file's bytes (not its name), and a
retriever for another model is refused at load, naming the file, before any document runs."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from flashmemory.demo.quality import QualityConfig, fingerprint, get_retriever
from flashmemory.eval.methods import METHODS
from flashmemory.retriever.checkpoint import CheckpointError, save_retriever
from flashmemory.retriever.model import JointRetriever, RetrieverDims

CFG = {"model": "/x/trained/dsv4-retrieval", "tau": 16}


def _ckpt(path, hidden: int = 128, head_dim: int = 64, layers=(0, 1, 2), seed: int = 0):
    import torch

    torch.manual_seed(seed)
    dims = RetrieverDims(hidden=hidden, rank=32, n_heads=4, head_dim=head_dim, rope_dim=32)
    return save_retriever(JointRetriever(layers, dims), path)


def test_resume_keys_on_the_retriever_bytes_not_its_path(tmp_path) -> None:
    a = _ckpt(tmp_path / "a.safetensors", seed=0)
    same = tmp_path / "elsewhere" / "copy.safetensors"
    same.parent.mkdir()
    shutil.copyfile(a, same)
    fp = fingerprint(CFG, QualityConfig(retriever=str(a)), METHODS)
    assert fingerprint(CFG, QualityConfig(retriever=str(same)), METHODS) == fp  # same file, another name
    _ckpt(a, seed=1)  # another file, same name
    assert fingerprint(CFG, QualityConfig(retriever=str(a)), METHODS) != fp


def test_a_missing_retriever_file_is_one_line_naming_it(tmp_path) -> None:
    with pytest.raises(Exception) as e:
        fingerprint(CFG, QualityConfig(retriever=str(tmp_path / "nope.safetensors")), METHODS)
    assert "--retriever" in str(e.value) and "nope.safetensors" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"hidden": 64}, "hidden size 64, the model's is 128"),
        ({"head_dim": 32}, "head dim 32, the model's indexer head dim is 64"),
        ({"layers": (0, 1)}, r"no retriever for c4 layer\(s\) \[2\]"),
    ],
)
def test_a_retriever_for_another_model_is_refused_at_load(tmp_path, kw, why) -> None:
    path = _ckpt(tmp_path / "other.safetensors", **kw)
    engine = SimpleNamespace(hidden_size=128, index_head_dim=64)
    qc = QualityConfig(out_dir=str(tmp_path / "out"), retriever=str(path))
    with pytest.raises(CheckpointError, match=why) as e:
        get_retriever(qc, None, tmp_path / "out", engine, None, (0, 1, 2), print, False)
    assert str(path) in str(e.value)
