"""The trained tiny DeepSeek-V4 padded into sglang's geometry computes what the source computes.

Through the reference engine (`HFEngine`, fp32, one forward over 300 tokens: the 32-token window, 75 c4 entries
of which top-16 attend, 2 c128 entries): the padded checkpoint's logits equal the source's within `LOGIT_TOL`
(measured 3.6e-5 of a logit range of ~16), its index keys are the source's at the mapped channels, and the padded
retriever scores the padded keys as the source retriever scores the source's. Keeping the source's YaRN betas
instead moves the logits far past the tolerance (the check has teeth).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashmemory.hf import HFEngine
from flashmemory.tiny.shipped import trained_model_available, trained_model_dir

pytestmark = pytest.mark.skipif(not trained_model_available(), reason="the shipped trained model is absent")

LOGIT_TOL = 1e-4
RETRIEVER = Path("docs/quality/frontier_retriever.safetensors")
SEQ = 300


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(10, 800, (SEQ,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def source():
    return HFEngine.from_name(str(trained_model_dir()))


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory) -> Path:
    from flashmemory.hf.pad_build import build_padded

    out = tmp_path_factory.mktemp("pad") / "padded"
    return build_padded(trained_model_dir(), out, index_topk=16, retriever=RETRIEVER)


def test_padded_checkpoint_has_sglangs_geometry(padded_dir: Path) -> None:
    from flashmemory.serve.model_check import _check_config

    cfg = json.loads((padded_dir / "config.json").read_text())
    assert (cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]) == (512, 64, 128)
    assert (cfg["window_size"], cfg["sliding_window"], cfg["compress_ratios"]) == (32, 32, [0, 4, 128, 4, 128, 4])
    cfg["index_topk"] = 512  # what the default build writes; this build keeps the source's 16
    _check_config(cfg, padded_dir / "config.json")


def test_padded_logits_equal_the_source(source: HFEngine, padded_dir: Path, ids: torch.Tensor) -> None:
    padded = HFEngine.from_name(str(padded_dir))
    with torch.no_grad():
        a, b = source.forward(ids), padded.forward(ids)
    assert (a.logits - b.logits).abs().max().item() <= LOGIT_TOL
    assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
    for lid in a.topk:
        same = torch.equal(a.topk[lid].sort(-1).values, b.topk[lid].sort(-1).values)  # order: near-ties may swap
        assert same, f"c4 layer {lid}: the indexer picks differ"


def test_padded_retriever_scores_the_padded_keys_as_the_source(
    source: HFEngine, padded_dir: Path, ids: torch.Tensor
) -> None:
    from flashmemory.hf.pad import head_pads
    from flashmemory.hf.pad_math import channel_map
    from flashmemory.retriever.checkpoint import check_fits, load_retriever
    from flashmemory.retriever.hadamard import hadamard_transform

    padded = HFEngine.from_name(str(padded_dir))
    src_ret, pad_ret = load_retriever(RETRIEVER), load_retriever(padded_dir / "retriever.safetensors")
    check_fits(pad_ret, "padded", padded.hidden_size, padded.index_head_dim, tuple(pad_ret.layers))
    with torch.no_grad():
        a, b = source.forward(ids), padded.forward(ids)
    cm = channel_map(head_pads(source.config)[1])
    pos = torch.arange(SEQ - 8, SEQ)
    for lid in src_ret.layers:
        ka, kb = a.index_keys[lid], b.index_keys[lid]
        assert torch.allclose(kb[:, cm], ka, atol=1e-5) and kb.abs().sum().item() == pytest.approx(
            ka.abs().sum().item(), rel=1e-5
        )
        # the retriever reads the keys as stored: Hadamard-rotated (fp8 left out: its rounding differs by width)
        sa = src_ret.layer(lid).logits(a.hidden[lid][-8:], pos, hadamard_transform(ka))
        sb = pad_ret.layer(lid).logits(b.hidden[lid][-8:], pos, hadamard_transform(kb))
        assert (sa - sb).abs().max().item() <= 1e-4 * max(1.0, sa.abs().max().item())


def test_the_source_betas_break_it(source: HFEngine, ids: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the same padding with the source's YaRN betas (the frequencies of the compressed layers'
    pairs move) is caught by the tolerance above, by far."""
    import flashmemory.hf.pad as pad

    monkeypatch.setattr(pad, "padded_betas", lambda config: (32.0, 1.0))
    model, _ = pad.pad_model(source.model, source.config, 16)
    with torch.no_grad():
        a, b = source.forward(ids), HFEngine(model, model.config).forward(ids)
    assert (a.logits - b.logits).abs().max().item() > 100 * LOGIT_TOL


def test_a_rebuild_keeps_an_intact_build_and_refuses_another(padded_dir: Path) -> None:
    from flashmemory.hf.pad_build import PadError, build_padded

    before = (padded_dir / "model.safetensors").stat().st_mtime_ns
    assert build_padded(trained_model_dir(), padded_dir, index_topk=16, retriever=RETRIEVER) == padded_dir
    assert (padded_dir / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(PadError, match="not an intact padded build"):
        build_padded(trained_model_dir(), padded_dir, index_topk=512)


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--src", "{tmp}"], "--src {tmp}: no config.json"),
        (["--retriever", "{tmp}/none.safetensors"], "--retriever {tmp}/none.safetensors: no such file"),
        (["--index-topk", "0"], "--index-topk 0: must be >= 1"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv, msg, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flashmemory.cli import main

    args = [a.format(tmp=tmp_path) for a in argv]
    assert main(["model", "pad", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flashmemory model pad: error: {msg.format(tmp=tmp_path)}"), err
    assert not (tmp_path / "out").exists()
