"""`flashmemory model build-serving`: seeded, deterministic, atomic; transformers loads exactly the built weights."""

import json

import pytest
import torch

from flashmemory.hf.models import build_random, load_model, make_config
from flashmemory.hf.serving_build import BuildError, build_serving, build_tokenizer
from flashmemory.hf.serving_model import SPECIAL_TOKENS, official_state_dict, serving_config


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_serving(tmp_path_factory.mktemp("m") / "serving-tiny", seed=0)


def test_geometry_sglang_needs(built):
    cfg = json.loads((built / "config.json").read_text())
    assert (cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["index_head_dim"], cfg["index_topk"]) == (512, 64, 128, 512)
    assert cfg["compress_ratios"] == [0, 4, 128, 4, 128, 0] and cfg["window_size"] == cfg["sliding_window"] == 128


def test_the_build_is_a_checkpoint_flashmemory_serve_accepts(built):
    from flashmemory.serve.model_check import check_serving_model

    assert check_serving_model(built) == built


def test_transformers_loads_the_exact_weights(built):
    model, _ = load_model(str(built), dtype=torch.bfloat16)
    ref = build_random(make_config(serving_config()), seed=0, dtype=torch.bfloat16)
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_official_names():
    names = set(official_state_dict(build_random(make_config(serving_config()), 0, torch.bfloat16)))
    for n in (
        "embed.weight",
        "head.weight",
        "norm.weight",
        "hc_head_fn",
        "layers.0.attn.attn_sink",
        "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.1.attn.indexer.wq_b.weight",
        "layers.1.attn.compressor.ape",
        "layers.2.ffn.experts.7.w3.weight",
        "layers.0.ffn.gate.tid2eid",
        "layers.3.hc_attn_fn",
        "layers.3.ffn.gate.bias",
    ):
        assert n in names, n
    assert not any(".self_attn." in n or ".mlp." in n or n.startswith("model.") for n in names)


def test_deterministic_and_idempotent(built, tmp_path):
    again = build_serving(tmp_path / "x", seed=0)
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / f).read_bytes() == (built / f).read_bytes()
    assert build_serving(again, seed=0) == again  # an intact build is kept
    with pytest.raises(BuildError, match="seed 1"):
        build_serving(again, seed=1)  # ... and never overwritten
    (tmp_path / "other").mkdir()
    with pytest.raises(BuildError):
        build_serving(tmp_path / "other", seed=0)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_tokenizer_specials_and_bytes():
    tok = build_tokenizer(1024)
    assert tok.get_vocab_size() == 1024
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert len(SPECIAL_TOKENS) == 26
    text = "<｜User｜>héllo, wörld<｜Assistant｜>"
    ids = tok.encode(text).ids
    assert ids[0] == SPECIAL_TOKENS.index("<｜User｜>") and ids[-1] == SPECIAL_TOKENS.index("<｜Assistant｜>")
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_init_std_is_recorded_and_checked(built, tmp_path):
    small = build_serving(tmp_path / "small", seed=0, init_std=0.02)
    man = json.loads((small / "flashmemory_build.json").read_text())
    assert man["init_std"] == 0.02 and "init_std" not in json.loads((built / "flashmemory_build.json").read_text())
    assert json.loads((small / "config.json").read_text())["initializer_range"] == 0.02
    a = load_model(str(small), dtype=torch.float32)[0].model.layers[1].self_attn.kv_proj.weight
    b = load_model(str(built), dtype=torch.float32)[0].model.layers[1].self_attn.kv_proj.weight
    assert 3 < float(b.detach().std() / a.detach().std()) < 7  # 0.1 vs 0.02
    assert build_serving(small, seed=0, init_std=0.02) == small  # kept
    with pytest.raises(BuildError, match="init_std 0.05"):
        build_serving(small, seed=0, init_std=0.05)
    with pytest.raises(BuildError, match="seed 0;"):
        build_serving(small, seed=0)  # the default build is another model
    with pytest.raises(BuildError, match="init_std must be"):
        build_serving(tmp_path / "bad", seed=0, init_std=float("nan"))
    assert not (tmp_path / "bad").exists()
