"""`flashmemory serve --model DIR` serves only a checkpoint sglang 0.5.23 can load: the trained HF model and broken
serving checkpoints are refused in one line naming the file and field, before anything starts."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from flashmemory.errors import UserError
from flashmemory.serve.model_check import check_serving_model

REPO = Path(__file__).resolve().parents[2]
TRAINED = REPO / "flashmemory" / "hf" / "trained" / "dsv4-retrieval"


@pytest.fixture(scope="module")
def serving(tmp_path_factory) -> Path:
    """The serving-tiny checkpoint's config and tokenizer as the builder writes them, with weights that hold only
    the embedding (the checks read the headers; the full build is accepted in tests/hf/test_serving_build.py)."""
    from safetensors.torch import save_file

    from flashmemory.hf.serving_build import build_tokenizer
    from flashmemory.hf.serving_model import serving_config

    d = tmp_path_factory.mktemp("m") / "serving"
    d.mkdir()
    cfg = serving_config()
    (d / "config.json").write_text(json.dumps(cfg))
    build_tokenizer(cfg["vocab_size"]).save(str(d / "tokenizer.json"))
    save_file(
        {"embed.weight": torch.zeros(cfg["vocab_size"], cfg["hidden_size"], dtype=torch.bfloat16)},
        str(d / "model.safetensors"),
    )
    return d


def _variant(serving: Path, tmp_path: Path, edit) -> Path:
    d = tmp_path / "m"
    shutil.copytree(serving, d)
    edit(d)
    return d


def _config(key, value):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def _drop_token(tok):
    def edit(d: Path) -> None:
        t = json.loads((d / "tokenizer.json").read_text())
        t["added_tokens"] = [a for a in t["added_tokens"] if a["content"] != tok]
        (d / "tokenizer.json").write_text(json.dumps(t))

    return edit


def test_a_serving_checkpoint_is_accepted(serving):
    assert check_serving_model(serving) == serving


def test_the_trained_hf_model_is_refused_on_its_head(capsys):
    """It has a config.json (and DeepseekV4ForCausalLM), but head 128: sglang's pool assert would stop the server
    minutes after start."""
    with pytest.raises(UserError) as e:
        check_serving_model(TRAINED)
    assert str(e.value).startswith(f"{TRAINED / 'config.json'}: head_dim=128: ")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "edit,want",
    [
        (_config("architectures", ["LlamaForCausalLM"]), "config.json: architectures=['LlamaForCausalLM']"),
        (_config("num_key_value_heads", 2), "config.json: num_key_value_heads=2"),
        (_config("index_head_dim", 64), "config.json: index_head_dim=64"),
        (_config("qk_rope_head_dim", 32), "config.json: qk_rope_head_dim=32"),
        (_config("compress_ratios", [0, 4, 8, 4, 128, 0]), "config.json: compress_ratios: [8] not among"),
        (_config("compress_ratios", [0, 4]), "config.json: compress_ratios=[0, 4]: sglang needs one"),
        (_config("index_topk", 16), "config.json: index_topk=16: sglang 0.5.23 accepts only 512 or 1024"),
        (lambda d: (d / "config.json").write_text("{"), "config.json is not readable JSON"),
        (lambda d: (d / "model.safetensors").unlink(), "no weights (model.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x05"), "model.safetensors: not a readable safetensors"),
        (_config("hidden_size", 128), "model.safetensors: embed.weight has shape [1024, 256], but config.json"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (_drop_token("<｜User｜>"), "tokenizer.json: added_tokens lacks the DeepSeek special token(s) <｜User｜>"),
    ],
)
def test_a_broken_serving_checkpoint_is_named(serving, tmp_path, edit, want):
    d = _variant(serving, tmp_path, edit)
    with pytest.raises(UserError) as e:
        check_serving_model(d)
    assert want in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_serve_refuses_the_trained_model_before_starting_anything(tmp_path, monkeypatch, capsys):
    """`flashmemory serve --model flashmemory/hf/trained/dsv4-retrieval` used to start P, D and the router, which
    then failed to load it; now one line, exit 2, and no server, retriever or log directory."""
    import flashmemory.serve.stack as st
    from flashmemory.cli import main

    def never(*a, **k):
        raise AssertionError("started something")

    monkeypatch.setattr(st, "start_pd", never)
    monkeypatch.setattr(st, "ensure_retriever", never)
    rc = main(["serve", "--model", str(TRAINED), "--port", "0", "--logs", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert rc == 2 and "head_dim=128" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "logs").exists()


def test_a_narrower_window_is_served_only_with_the_window_row(serving, tmp_path):
    """sglang attends its SWA_WINDOW (128) whatever config.json says: a window-32 checkpoint (the padded trained
    model) needs the CPU layer's window row at 32, and the row at 32 refuses a window-128 checkpoint."""
    d = _variant(serving, tmp_path, lambda d: (_config("window_size", 32)(d), _config("sliding_window", 32)(d)))
    with pytest.raises(UserError, match=r"window_size=32: sglang 0.5.23 attends 128 .*SWA_WINDOW=32$"):
        check_serving_model(d)
    assert check_serving_model(d, swa_window=32) == d
    with pytest.raises(UserError, match="window_size=128, but SGLANG_FLASHMEMORY_CPU_SWA_WINDOW=32"):
        check_serving_model(serving, swa_window=32)
