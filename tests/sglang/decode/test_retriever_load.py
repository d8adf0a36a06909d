"""The serving path's retriever load (what the plugin checks at registration and the engine serves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.retriever.checkpoint import CheckpointError, save_retriever
from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.retriever.rope import RopeConfig, rope_angles, yarn_inv_freq
from flashmemory.sglang.decode.retriever_load import load_serving_retriever, model_hidden_size, served_model_path

DIMS = RetrieverDims(hidden=32, rank=16, n_heads=4, head_dim=128, rope_dim=64)
FAR = torch.tensor([300_000, 700_000, 1_048_575])


def _env(ckpt: Path, **kw) -> FlashMemoryEnv:
    base = {
        "SGLANG_DECODE_SWAP_P": "1",
        "SGLANG_RETRIEVER_INLINE_CKPT": str(ckpt),
        "SGLANG_RETRIEVER_INLINE_LAYERS": "10,12",
    }
    return FlashMemoryEnv.from_environ(base | kw)


def _short_table_ckpt(path: Path) -> tuple[Path, JointRetriever]:
    """A checkpoint as training wrote it before: RoPE metadata with max_position 131072."""
    torch.manual_seed(0)
    model = JointRetriever((10, 12), DIMS, RopeConfig(max_position=131072))
    return save_retriever(model, path), model


def test_far_positions_get_distinct_exact_angles_and_scores(tmp_path: Path) -> None:
    ck, trained = _short_table_ckpt(tmp_path / "r.safetensors")
    assert json.loads(__import__("safetensors").safe_open(str(ck), "pt").metadata()["rope"])["max_position"] == 131072
    served = load_serving_retriever(_env(ck))
    assert served.rope.max_position == 1_048_576 and served.layer(12).rope.max_position == 1_048_576
    ang = rope_angles(FAR, served.rope)
    exact = FAR.to(torch.float64).unsqueeze(-1) * yarn_inv_freq(served.rope)
    assert torch.equal(ang, exact)  # no clamp: 300K, 700K and 1,048,575 keep their own angles
    # Scores through the served layer: one hidden state at the three positions gives three different rows,
    # each equal to a model built with the full-length RoPE directly.
    ref = JointRetriever((10, 12), DIMS, RopeConfig(max_position=1 << 20))
    ref.load_state_dict(trained.state_dict())
    h = torch.randn(1, DIMS.hidden).expand(3, -1)
    keys = torch.randn(50, DIMS.head_dim)
    got = served.layer(10).logits(h, FAR, keys)
    assert torch.allclose(got, ref.layer(10).logits(h, FAR, keys), atol=1e-5)
    assert not torch.allclose(got[0], got[1]) and not torch.allclose(got[1], got[2])


def test_max_position_env_overrides_an_upstream_pt_too(tmp_path: Path) -> None:
    model = JointRetriever((10, 12), DIMS)
    pt = tmp_path / "up.pt"
    torch.save({f"retrievers.l{lid}.{k}": v for lid in (10, 12) for k, v in model.layer(lid).state_dict().items()}, pt)
    served = load_serving_retriever(_env(pt, SGLANG_RETRIEVER_MAX_POSITION="2097152"))
    assert served.rope.max_position == 2_097_152
    assert rope_angles(torch.tensor([2_000_000]), served.rope)[0, 0] == 2_000_000 * yarn_inv_freq(served.rope)[0]


def _model_dir(tmp_path: Path, hidden: int) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    return d


def test_bad_checkpoints_are_one_line_naming_variable_file_and_tensor(tmp_path: Path) -> None:
    ck, model = _short_table_ckpt(tmp_path / "r.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"SGLANG_RETRIEVER_INLINE_CKPT=.*r\.safetensors.*hidden size 32 .*"
        r"hidden_size 4096 .*config\.json",
    ):
        load_serving_retriever(_env(ck), _model_dir(tmp_path, 4096))
    assert load_serving_retriever(_env(ck), _model_dir(tmp_path, 32)).dims.hidden == 32
    with pytest.raises(CheckpointError, match=r"layer\(s\) \[20\] not in checkpoint.*INLINE_LAYERS"):
        load_serving_retriever(_env(ck, SGLANG_RETRIEVER_INLINE_LAYERS="10,20"))
    from safetensors.torch import load_file, save_file

    sd = load_file(str(ck))
    sd["retrievers.l12.wq_b.weight"][3, 5] = float("nan")
    save_file(sd, str(tmp_path / "nan.safetensors"))
    with pytest.raises(CheckpointError, match=r"nan\.safetensors: retrievers\.l12\.wq_b\.weight holds 1 non-finite"):
        load_serving_retriever(_env(tmp_path / "nan.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes(ck.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="cut.safetensors.*truncated"):
        load_serving_retriever(_env(tmp_path / "cut.safetensors"))


def test_model_path_from_server_args_or_the_launch_command(tmp_path: Path) -> None:
    class Args:
        model_path = "/m/a"

    assert served_model_path(Args(), ["--model-path", "/m/b"]) == "/m/a"
    assert served_model_path(None, ["x", "--model-path", "/m/b", "--tp", "8"]) == "/m/b"
    assert served_model_path(None, ["--model=/m/c"]) == "/m/c"
    assert served_model_path(None, ["--port", "1"]) is None
    assert model_hidden_size("deepseek-ai/DeepSeek-V4-Flash")[0] is None  # a Hub id: not checked here
    assert model_hidden_size(_model_dir(tmp_path, 4096)) == (4096, str(tmp_path / "model" / "config.json"))
    (tmp_path / "model" / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="config.json: unreadable model config"):
        model_hidden_size(tmp_path / "model")
