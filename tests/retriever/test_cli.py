"""`flashmemory checkpoint inspect|convert|download`, driven through flashmemory.cli.main."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashmemory.cli import main
from flashmemory.retriever.checkpoint import load_retriever, read_state

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_joint(path: Path, layers=(10, 12, 20), hidden=48, rank=24, heads=4, hd=16) -> dict[str, torch.Tensor]:
    sd = {}
    for lid in layers:
        p = f"retrievers.l{lid}."
        sd[p + "wq_a.weight"] = torch.randn(rank, hidden)
        sd[p + "wq_b.weight"] = torch.randn(heads * hd, rank)
        sd[p + "q_norm_weight"] = torch.rand(rank)
        sd[p + "weights_proj.weight"] = torch.randn(heads, hidden)
        sd[p + "freqs_cis"] = torch.polar(torch.ones(8, 4), torch.rand(8, 4))
    torch.save(sd, path)
    return sd


def test_inspect_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_joint(tmp_path / "j.pt")
    assert main(["checkpoint", "inspect", str(tmp_path / "j.pt")]) == 0
    out = capsys.readouterr().out
    assert "10, 12, 20" in out and "heads 4 x 16" in out and "rank 24" in out and "hidden 48" in out
    n = 3 * (24 * 48 + 64 * 24 + 24 + 4 * 48)
    assert f"{n:,}" in out and "torch.float32" in out and "freqs_cis" in out
    assert main(["checkpoint", "inspect", "--json", str(tmp_path / "j.pt")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] == [10, 12, 20] and info["n_params"] == n
    assert info["dims"]["12"] == {"hidden": 48, "rank": 24, "n_heads": 4, "head_dim": 16, "rope_dim": 8}


def test_inspect_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["checkpoint", "inspect", str(tmp_path / "missing.pt")]) == 1
    assert "missing.pt: no such file" in capsys.readouterr().err
    sd = {k.removeprefix("retrievers.l10."): v for k, v in write_joint(tmp_path / "a.pt", layers=(10,)).items()}
    torch.save(sd, tmp_path / "single.pt")
    assert main(["checkpoint", "inspect", str(tmp_path / "single.pt")]) == 1
    assert "single-layer" in capsys.readouterr().err
    assert main(["checkpoint", "inspect", "--layer", "12", str(tmp_path / "single.pt")]) == 0
    assert "l12" in capsys.readouterr().out


def test_convert(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sd = write_joint(tmp_path / "j.pt")
    dst = tmp_path / "out" / "j.safetensors"
    assert main(["checkpoint", "convert", str(tmp_path / "j.pt"), str(dst)]) == 0
    assert "wrote" in capsys.readouterr().out
    state, meta = read_state(dst)
    assert set(state) == {k for k in sd if not k.endswith("freqs_cis")}
    for k, v in state.items():
        assert torch.equal(v, sd[k])
    assert meta["source"] == "j.pt" and json.loads(meta["rope"])["rope_dim"] == 8
    # Refuses to overwrite without --force, and a non-safetensors output.
    assert main(["checkpoint", "convert", str(tmp_path / "j.pt"), str(dst)]) == 1
    assert "--force" in capsys.readouterr().err
    assert (
        main(
            ["checkpoint", "convert", "--force", "--layers", "12", "--rope-dim", "4", str(tmp_path / "j.pt"), str(dst)]
        )
        == 0
    )
    model = load_retriever(dst)
    assert model.layers == (12,) and model.rope.rope_dim == 4
    assert main(["checkpoint", "convert", str(tmp_path / "j.pt"), str(tmp_path / "x.pt")]) == 1
    assert ".safetensors" in capsys.readouterr().err
    src = str(tmp_path / "j.pt")
    assert main(["checkpoint", "convert", "--layers", "10,b", src, str(tmp_path / "y.safetensors")]) == 1
    assert "--layers" in capsys.readouterr().err
    assert main(["checkpoint", "convert", "--rope-dim", "7", src, str(tmp_path / "z.safetensors")]) == 1
    assert "rope_dim" in capsys.readouterr().err
    assert not (tmp_path / "z.safetensors").exists()


def test_convert_single_layer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sd = {k.removeprefix("retrievers.l10."): v for k, v in write_joint(tmp_path / "a.pt", layers=(10,)).items()}
    torch.save(sd, tmp_path / "single.pt")
    dst = tmp_path / "single.safetensors"
    assert main(["checkpoint", "convert", str(tmp_path / "single.pt"), str(dst)]) == 1
    assert "single-layer" in capsys.readouterr().err and not dst.exists()
    assert main(["checkpoint", "convert", "--layer", "20", str(tmp_path / "single.pt"), str(dst)]) == 0
    model = load_retriever(dst)
    assert model.layers == (20,) and torch.equal(model.layer(20).wq_b.weight.detach(), sd["wq_b.weight"])


def test_download_offline_subprocess(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "flashmemory.cli", "checkpoint", "download", "--dest", str(tmp_path / "d")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert r.returncode == 1, r.stderr
    assert "could not download libertywing/FlashMemory-Deepseek-V4/top3_R930_joint.pt" in r.stderr
    assert "HF_HUB_OFFLINE" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "d" / "top3_R930_joint.pt").exists()


def test_download_unreachable_endpoint_fails_before_the_hub(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    called = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kw: called.append(kw))
    assert main(["checkpoint", "download", "--dest", str(tmp_path), "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach 127.0.0.1:9" in err and not called


def test_download_reports_hub_errors_and_success(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    import flashmemory.retriever.cli as cli

    monkeypatch.setattr(cli, "_reachable", lambda timeout: "")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def boom(**kw):
        raise LocalEntryNotFoundError("cannot find the requested files")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", boom)
    assert main(["checkpoint", "download", "--repo", "me/x", "--file", "w.pt", "--dest", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "me/x/w.pt" in err and "LocalEntryNotFoundError" in err
    seen = {}

    def ok(**kw):
        seen.update(kw)
        return str(Path(kw["local_dir"]) / kw["filename"])

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", ok)
    assert main(["checkpoint", "download", "--dest", str(tmp_path), "--timeout", "4"]) == 0
    assert seen["repo_id"] == "libertywing/FlashMemory-Deepseek-V4" and seen["filename"] == "top3_R930_joint.pt"
    assert seen["etag_timeout"] == 4.0 and Path(seen["local_dir"]) == tmp_path
    assert str(tmp_path / "top3_R930_joint.pt") in capsys.readouterr().out


@pytest.mark.parametrize("timeout", ["-1", "nan", "0", "inf"])
def test_download_timeout_out_of_range_is_one_line_naming_the_flag(
    timeout: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A negative or NaN --timeout made the socket probe raise a traceback, and 0 (a non-blocking probe) was
    reported as "no network?": each is refused before any network use, in one line naming --timeout."""
    import huggingface_hub

    import flashmemory.retriever.cli as cli

    called = []
    monkeypatch.setattr(cli, "_reachable", lambda t: called.append(t) or "")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kw: called.append(kw))
    assert main(["checkpoint", "download", "--dest", str(tmp_path), "--timeout", timeout]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--timeout" in err[0] and "no network" not in err[0], err
    assert not called and list(tmp_path.iterdir()) == []


def test_checkpoint_without_action_prints_help(capsys: pytest.CaptureFixture) -> None:
    assert main(["checkpoint"]) == 2
    assert "inspect" in capsys.readouterr().out


def _nan_and_misshapen(tmp_path: Path) -> tuple[Path, Path]:
    sd = write_joint(tmp_path / "ok.pt")
    nan = dict(sd)
    nan["retrievers.l12.q_norm_weight"] = sd["retrievers.l12.q_norm_weight"].clone()
    nan["retrievers.l12.q_norm_weight"][2] = float("nan")
    torch.save(nan, tmp_path / "nan.pt")
    bad = dict(sd)
    bad["retrievers.l20.wq_b.weight"] = torch.randn(64, 23)  # rank 23 where the others have 24
    torch.save(bad, tmp_path / "shape.pt")
    return tmp_path / "nan.pt", tmp_path / "shape.pt"


def test_inspect_and_convert_refuse_nan_and_wrong_shapes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    nan, shape = _nan_and_misshapen(tmp_path)
    assert main(["checkpoint", "inspect", str(nan)]) == 1
    err = capsys.readouterr().err
    assert "nan.pt: retrievers.l12.q_norm_weight holds 1 non-finite value(s)" in err and len(err.splitlines()) == 1
    assert main(["checkpoint", "inspect", str(shape)]) == 1
    assert "retrievers.l20.wq_b.weight: shape (64, 23) does not match (64, 24) of layer 10" in capsys.readouterr().err
    for src in (nan, shape):
        assert main(["checkpoint", "convert", str(src), str(tmp_path / "o.safetensors")]) == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    nan, _ = _nan_and_misshapen(tmp_path)
    from flashmemory.retriever.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="non-finite"):
        main(["checkpoint", "inspect", str(nan), "--debug"])
    with pytest.raises(CheckpointError, match="non-finite"):
        main(["--debug", "checkpoint", "convert", str(nan), str(tmp_path / "o.safetensors")])
    assert main(["checkpoint", "inspect", str(nan)]) == 1  # and without it, one line again


def test_convert_force_onto_a_directory_leaves_nothing_behind(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_joint(tmp_path / "j.pt")
    dst = tmp_path / "d.safetensors"
    dst.mkdir()
    (dst / "user_file").write_text("mine")
    assert main(["checkpoint", "convert", "--force", str(tmp_path / "j.pt"), str(dst)]) == 1
    assert "d.safetensors: is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors", "j.pt"]
    assert (dst / "user_file").read_text() == "mine"


def test_save_never_writes_a_nan_checkpoint_nor_leaves_a_temp_file(tmp_path: Path) -> None:
    from flashmemory.retriever.checkpoint import CheckpointError, save_retriever
    from flashmemory.retriever.model import JointRetriever, RetrieverDims

    m = JointRetriever((3,), RetrieverDims(hidden=8, rank=4, n_heads=2, head_dim=8, rope_dim=4))
    with torch.no_grad():
        m.layer(3).wq_a.weight[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match=r"retrievers\.l3\.wq_a\.weight holds 1 non-finite"):
        save_retriever(m, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_convert_on_a_full_disk_is_one_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed safetensors write was a `SafetensorError` traceback. README "Errors and data safety":
    one line naming the file and the cause (a full path included), non-zero exit; writes are atomic (the temp
    file is removed). The write really starts (bytes reach the temp file), then fails the way safetensors reports
    ENOSPC: "I/O error: No space left on device (os error 28)"."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    write_joint(tmp_path / "j.pt")
    dst = tmp_path / "j.safetensors"
    assert main(["checkpoint", "convert", str(tmp_path / "j.pt"), str(dst)]) == 1
    err = capsys.readouterr().err
    assert err == f"flashmemory checkpoint convert: error: {dst}: No space left on device (disk full)\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j.pt"]  # no temp file, no partial output


def test_inspect_and_convert_name_the_keys_they_ignore(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`checkpoint inspect` skipped keys it does not know without a word. README "Errors and data
    safety" (nothing is silently dropped): inspect lists them, convert says they were not converted."""
    sd = write_joint(tmp_path / "j.pt", layers=(10,))
    sd["retrievers.l10.bias_extra"] = torch.zeros(3)
    sd["optimizer_step"] = torch.tensor(7)
    torch.save(sd, tmp_path / "extra.pt")
    assert main(["checkpoint", "inspect", str(tmp_path / "extra.pt")]) == 0
    out = capsys.readouterr().out
    assert (
        "unknown     2 key(s) the retriever does not use (not loaded, not converted): optimizer_step, "
        "retrievers.l10.bias_extra"
    ) in out, out
    assert f"{24 * 48 + 64 * 24 + 24 + 4 * 48:,}" in out  # the parameter count counts retriever weights only
    assert main(["checkpoint", "inspect", "--json", str(tmp_path / "extra.pt")]) == 0
    assert json.loads(capsys.readouterr().out)["unknown_keys"] == ["optimizer_step", "retrievers.l10.bias_extra"]
    assert main(["checkpoint", "convert", str(tmp_path / "extra.pt"), str(tmp_path / "e.safetensors")]) == 0
    assert "2 key(s) the retriever does not use" in capsys.readouterr().err
    assert main(["checkpoint", "inspect", str(tmp_path / "j.pt")]) == 0
    assert "unknown" not in capsys.readouterr().out  # freqs_cis is a known buffer, reported as such
