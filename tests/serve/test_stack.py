"""`ensure_retriever`: `make serve` runs Level 1 by default with a retriever built once for the served model."""

import pytest

from flashmemory.serve import stack
from flashmemory.train.loop import BEST_F1


def _fake_train(calls, fail=False):
    def train(model, out):
        calls.append(out)
        (out / "ckpt").mkdir(parents=True)
        if fail:
            raise RuntimeError("interrupted")
        (out / "ckpt" / BEST_F1).write_bytes(b"weights")
        return out / "ckpt" / BEST_F1

    return train


def test_built_once_beside_the_model_then_reused(tmp_path, monkeypatch):
    import flashmemory.serve.tiny_retriever as tr

    calls: list = []
    monkeypatch.setattr(tr, "train_tiny_retriever", _fake_train(calls))
    model = tmp_path / "tiny-dsv4-sglang"
    first = stack.ensure_retriever(model)
    assert first == tmp_path / "tiny-dsv4-sglang-retriever" / "ckpt" / BEST_F1 and first.read_bytes() == b"weights"
    assert stack.ensure_retriever(model) == first and len(calls) == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_an_interrupted_build_leaves_no_checkpoint_to_mistake_for_a_whole_one(tmp_path, monkeypatch):
    import flashmemory.serve.tiny_retriever as tr

    calls: list = []
    monkeypatch.setattr(tr, "train_tiny_retriever", _fake_train(calls, fail=True))
    with pytest.raises(RuntimeError, match="interrupted"):
        stack.ensure_retriever(tmp_path / "m")
    assert not stack.retriever_dir(tmp_path / "m").exists()
    monkeypatch.setattr(tr, "train_tiny_retriever", _fake_train(calls))
    assert stack.ensure_retriever(tmp_path / "m").is_file()
