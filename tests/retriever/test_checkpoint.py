"""Checkpoint round trips (upstream joint .pt, unprefixed single layer, our safetensors) and every error path."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from flashmemory.retriever.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    load_retriever,
    read_state,
    save_retriever,
)
from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.retriever.rope import RopeConfig

DIMS = RetrieverDims(hidden=48, rank=24, n_heads=4, head_dim=16, rope_dim=8)
PARAMS = ("wq_a.weight", "wq_b.weight", "q_norm_weight", "weights_proj.weight")


def upstream_state(layers=(10, 12, 20), dims: RetrieverDims = DIMS, seed: int = 0) -> dict[str, torch.Tensor]:
    """What upstream's JointLayerRetriever.state_dict() holds, freqs_cis buffer included."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for lid in layers:
        p = f"retrievers.l{lid}."
        sd[p + "wq_a.weight"] = torch.randn(dims.rank, dims.hidden, generator=g)
        sd[p + "wq_b.weight"] = torch.randn(dims.n_heads * dims.head_dim, dims.rank, generator=g)
        sd[p + "q_norm_weight"] = torch.rand(dims.rank, generator=g) + 0.5
        sd[p + "weights_proj.weight"] = torch.randn(dims.n_heads, dims.hidden, generator=g)
        sd[p + "freqs_cis"] = torch.polar(torch.ones(32, dims.rope_dim // 2), torch.rand(32, dims.rope_dim // 2))
    return sd


def assert_weights(
    model: JointRetriever, sd: dict[str, torch.Tensor], prefix=lambda lid: f"retrievers.l{lid}."
) -> None:
    for lid in model.layers:
        for k in PARAMS:
            assert torch.equal(model.layer(lid).get_parameter(k).detach(), sd[prefix(lid) + k].float()), (lid, k)


def test_pt_round_trip_ignores_freqs_cis(tmp_path: Path) -> None:
    sd = upstream_state()
    assert sd["retrievers.l10.freqs_cis"].dtype == torch.complex64
    torch.save(sd, tmp_path / "joint.pt")
    model = load_retriever(tmp_path / "joint.pt")
    assert model.layers == (10, 12, 20) and model.dims == DIMS
    assert model.rope.rope_dim == 8  # head_dim < 128: half the head
    assert_weights(model, sd)
    only = load_retriever(tmp_path / "joint.pt", layers=[12])
    assert only.layers == (12,)
    info = inspect_checkpoint(tmp_path / "joint.pt")
    assert info["layers"] == [10, 12, 20]
    assert info["ignored_keys"] == [f"retrievers.l{i}.freqs_cis" for i in (10, 12, 20)]
    assert info["n_params"] == 3 * (24 * 48 + 64 * 24 + 24 + 4 * 48)
    assert info["dims"][10] == DIMS.__dict__


def test_bf16_pt_and_training_wrapper(tmp_path: Path) -> None:
    sd = {k: v.to(torch.bfloat16) for k, v in upstream_state((10,)).items() if not k.endswith("freqs_cis")}
    torch.save({"model_state": sd, "epoch": torch.tensor(3)}, tmp_path / "epoch.pt")
    model = load_retriever(tmp_path / "epoch.pt")
    assert_weights(model, sd)
    assert model.layer(10).wq_a.weight.dtype == torch.float32


def test_safetensors_round_trip_keeps_metadata(tmp_path: Path) -> None:
    torch.save(upstream_state(), tmp_path / "joint.pt")
    model = load_retriever(tmp_path / "joint.pt", rope=RopeConfig(rope_dim=8, max_position=4096))
    out = save_retriever(model, tmp_path / "sub" / "joint.safetensors")
    assert out.is_file() and not list(out.parent.glob("*.tmp*"))
    back = load_retriever(out)
    assert back.layers == model.layers and back.dims == model.dims
    assert back.rope == RopeConfig(rope_dim=8, max_position=4096)  # from the metadata, not the default
    assert_weights(
        back,
        {f"retrievers.l{lid}.{k}": model.layer(lid).get_parameter(k).detach() for lid in model.layers for k in PARAMS},
    )
    state, meta = read_state(out)
    assert set(state) == {f"retrievers.l{i}.{k}" for i in (10, 12, 20) for k in PARAMS}
    assert meta["layers"] == "10,12,20" and json.loads(meta["dims"])["n_heads"] == 4
    x, pos, keys = torch.randn(2, 48), torch.tensor([1, 9000]), torch.randn(7, 16)
    with torch.no_grad():
        assert torch.equal(back.layer(20)(x, pos, keys), model.layer(20)(x, pos, keys))


def test_unprefixed_single_layer(tmp_path: Path) -> None:
    sd = {k.removeprefix("retrievers.l10."): v for k, v in upstream_state((10,)).items()}
    torch.save(sd, tmp_path / "single.pt")
    model = load_retriever(tmp_path / "single.pt", single_layer_id=12)
    assert model.layers == (12,)
    assert_weights(model, sd, prefix=lambda lid: "")
    with pytest.raises(CheckpointError, match="single-layer"):
        load_retriever(tmp_path / "single.pt")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_truncated_file(tmp_path: Path, suffix: str) -> None:
    good = tmp_path / ("good" + suffix)
    if suffix == ".pt":
        torch.save(upstream_state(), good)
    else:
        save_retriever(load_retriever(_pt(tmp_path)), good)
    data = good.read_bytes()
    bad = tmp_path / ("bad" + suffix)
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_retriever(bad)
    assert str(bad) in str(e.value)
    (tmp_path / ("zero" + suffix)).write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated"):
        load_retriever(tmp_path / ("zero" + suffix))


def _pt(tmp_path: Path, sd: dict | None = None, name: str = "joint.pt") -> Path:
    p = tmp_path / name
    torch.save(upstream_state() if sd is None else sd, p)
    return p


def test_wrong_shape_names_key_and_shapes(tmp_path: Path) -> None:
    sd = upstream_state()
    sd["retrievers.l12.wq_b.weight"] = torch.randn(64, 23)
    with pytest.raises(CheckpointError, match=r"retrievers\.l12\.wq_b\.weight.*\(64, 23\).*\(64, 24\)"):
        load_retriever(_pt(tmp_path, sd))
    sd = upstream_state()
    sd["retrievers.l20.q_norm_weight"] = torch.randn(25)
    with pytest.raises(CheckpointError, match=r"retrievers\.l20\.q_norm_weight.*\(25,\)"):
        load_retriever(_pt(tmp_path, sd))
    sd = upstream_state()
    sd["retrievers.l10.wq_a.weight"] = torch.randn(24 * 48)  # 1-D: cannot give (rank, hidden)
    with pytest.raises(CheckpointError, match=r"retrievers\.l10\.wq_a\.weight"):
        load_retriever(_pt(tmp_path, sd))
    sd = upstream_state()
    sd["retrievers.l10.weights_proj.weight"] = torch.randn(5, 48)  # 64 rows of wq_b not divisible by 5 heads
    with pytest.raises(CheckpointError, match="divisible"):
        load_retriever(_pt(tmp_path, sd))
    with pytest.raises(CheckpointError, match="hidden size 48 != model hidden size 4096"):
        load_retriever(_pt(tmp_path), expect_hidden=4096)


def test_missing_layer_and_key(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"\[13\].*\[10, 12, 20\]"):
        load_retriever(_pt(tmp_path), layers=[10, 13])
    sd = upstream_state()
    del sd["retrievers.l12.q_norm_weight"]
    with pytest.raises(CheckpointError, match=r"retrievers\.l12\.q_norm_weight"):
        load_retriever(_pt(tmp_path, sd))
    sd = upstream_state()
    del sd["retrievers.l10.wq_a.weight"]
    with pytest.raises(CheckpointError, match=r"retrievers\.l10\.wq_a\.weight"):
        load_retriever(_pt(tmp_path, sd))
    with pytest.raises(CheckpointError, match="no retriever weights"):
        load_retriever(_pt(tmp_path, {}))


class Evil:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        load_retriever(tmp_path / "nope.pt")
    (tmp_path / "x.npz").write_bytes(b"123")
    with pytest.raises(CheckpointError, match="unknown checkpoint type"):
        load_retriever(tmp_path / "x.npz")
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"retrievers.l10.wq_a.weight": Evil()}, f, protocol=2)
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_retriever(tmp_path / "evil.pt")
    assert "unpickled code ran" not in capsys.readouterr().out
    torch.save({"a": 1}, tmp_path / "notensors.pt")
    with pytest.raises(CheckpointError, match="dict of tensors"):
        load_retriever(tmp_path / "notensors.pt")


def test_bad_rope_metadata(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    sd = {k: v for k, v in upstream_state((10,)).items() if not k.endswith("freqs_cis")}
    save_file(sd, str(tmp_path / "m.safetensors"), metadata={"rope": '{"rope_dim": 7}'})
    with pytest.raises(CheckpointError, match="rope"):
        load_retriever(tmp_path / "m.safetensors")
