"""A frontier run's identity (`eval.frontier.identity`): the model by content, --compare naming the setting two
runs differ in, and the committed runs (records of the older fingerprint) still readable (no model runs here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flashmemory.errors import UserError
from flashmemory.eval.frontier import run as fr
from flashmemory.eval.frontier.identity import legacy_fingerprint, model_digest
from flashmemory.tiny.shipped import trained_model_dir
from tests.eval.frontier.test_run import FakeSweep

COMMITTED = Path("docs/quality/frontier_run")
RETRIEVER = "docs/quality/frontier_retriever.safetensors"


@pytest.fixture
def fc(tmp_path):
    ck = tmp_path / "r.safetensors"
    ck.write_bytes(b"weights")
    return fr.FrontierConfig(
        out_dir=str(tmp_path / "out"), retriever=str(ck), n_per_task=1, budgets=(0.1, 0.5), tasks=("mqar",)
    )


def _model(path: Path, weights: bytes) -> str:
    path.mkdir(parents=True)
    shutil.copyfile(trained_model_dir() / "config.json", path / "config.json")
    (path / "model.safetensors").write_bytes(weights)
    return str(path)


def test_the_model_is_fingerprinted_by_content(fc, tmp_path):
    a = _model(tmp_path / "a" / "m", b"one")
    b = _model(tmp_path / "b" / "m", b"two")  # another model under the same directory name
    c = _model(tmp_path / "c" / "other", b"one")  # the same model under another name
    fp = {m: fr.fingerprint(fr.FrontierConfig(**{**fc.__dict__, "model": m})) for m in (a, b, c)}
    assert fp[a] != fp[b] and fp[a] == fp[c]
    shipped = fr.fingerprint(fc)
    assert fr.fingerprint(fr.FrontierConfig(**{**fc.__dict__, "model": str(trained_model_dir())})) == shipped
    assert model_digest("micro") != model_digest("tiny-flash")
    with pytest.raises(UserError, match="--model nowhere: neither"):
        model_digest("nowhere")


def test_two_models_of_one_name_never_mix_in_one_dir(fc, tmp_path, monkeypatch):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    one = fr.FrontierConfig(**{**fc.__dict__, "model": _model(tmp_path / "a" / "m", b"one"), "n_per_task": 1})
    fr.run_frontier(one, log=lambda s: None, progress=False)
    two = fr.FrontierConfig(**{**one.__dict__, "model": _model(tmp_path / "b" / "m", b"two"), "n_per_task": 2})
    with pytest.raises(UserError, match=r"00008\.json: written by a frontier run with another configuration"):
        fr.run_frontier(two, log=lambda s: None, progress=False)


def test_the_shipped_model_named_by_its_path_resumes_the_default_run(fc, monkeypatch):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    fr.run_frontier(fc, log=lambda s: None, progress=False)
    FakeSweep.calls = []
    by_path = fr.FrontierConfig(**{**fc.__dict__, "model": str(trained_model_dir()), "n_per_task": 2})
    res = fr.run_frontier(by_path, log=lambda s: None, progress=False)
    assert FakeSweep.calls == [9] and res["docs_done"] == 2  # document 8 was read back, not refused or redone


@pytest.mark.parametrize(
    "change, words",
    [
        ({"gen_tokens": 16}, "--gen-tokens differs (16 there, 24 here)"),
        ({"budgets": (0.1, 0.25)}, "budgets differ (--budgets 0.1,0.25 there, 0.1,0.5 here)"),
        ({"tau": 8}, "--tau differs"),
        ({"topp": 0.5}, "setting topp differs"),
        ({"retriever": "other"}, "--retriever differs"),
    ],
)
def test_compare_names_the_setting_that_differs(fc, tmp_path, monkeypatch, change, words):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    if change.get("retriever") == "other":
        (tmp_path / "other.safetensors").write_bytes(b"other weights")
        change = {"retriever": str(tmp_path / "other.safetensors")}
    fill = fr.FrontierConfig(
        **{**fc.__dict__, **change, "out_dir": fc.out_dir + "_fill", "methods": ("FlashMemory-fill",)}
    )
    fr.run_frontier(fill, log=lambda s: None, progress=False)
    with pytest.raises(UserError) as e:
        fr.run_frontier(fc, log=lambda s: None, progress=False, compare=fill.out_dir)
    assert f"--compare {fill.out_dir}: document 8: {words}" in str(e.value) and "\n" not in str(e.value)


def test_compare_refuses_a_quality_dir(fc, tmp_path, monkeypatch):
    from flashmemory.demo.quality import FORMAT, write_doc

    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    other = tmp_path / "quality"
    row = {"task_score": 1.0}
    rec = {"format": FORMAT, "fingerprint": "f", "index": 8, "task": "mqar", "seconds": 1.0}
    write_doc(other, rec | {"budgets": {"0.1": {"Full": row}}})
    with pytest.raises(UserError, match=r"--compare .*quality: holds the output of `flashmemory eval quality`"):
        fr.run_frontier(fc, log=lambda s: None, progress=False, compare=str(other))


def _committed_copy(tmp_path: Path, name: str, n: int = 3) -> Path:
    """The first n documents of a committed run's directory, copied (the committed one stays untouched)."""
    src = Path(str(COMMITTED).replace("frontier_run", name))
    dst = tmp_path / name / "docs"
    dst.mkdir(parents=True)
    for p in sorted((src / "docs").glob("*.json"))[:n]:
        shutil.copyfile(p, dst / p.name)
    return dst.parent


@pytest.mark.skipif(not (COMMITTED / "docs" / "00008.json").is_file(), reason="committed frontier run absent")
def test_the_committed_runs_still_report_and_compare(tmp_path, monkeypatch):
    monkeypatch.setattr(fr, "Sweep", FakeSweep)
    main, fill = _committed_copy(tmp_path, "frontier_run"), _committed_copy(tmp_path, "frontier_fill_run")
    fc = fr.FrontierConfig(out_dir=str(main), retriever=RETRIEVER, n_per_task=1)
    rec = json.loads((main / "docs" / "00008.json").read_text())
    assert "settings" not in rec and rec["fingerprint"] == legacy_fingerprint(fc, "shipped")
    with pytest.raises(UserError, match="--recost"):  # its HiSparse rows took the prefetch arm's misses
        fr.run_frontier(fc, log=lambda s: None, progress=False, report_only=True, compare=str(fill))
    res = fr.run_frontier(fc, log=lambda s: None, progress=False, compare=str(fill), recost=True)
    assert json.loads((main / "docs" / "00008.json").read_text())["fingerprint"] == rec["fingerprint"]
    assert f"(records of the older fingerprint scheme: `{rec['fingerprint']}`)" in (main / "frontier.md").read_text()
    assert res["docs_done"] == 3 and "3 documents in both runs; FlashMemory-fill" in (main / "frontier.md").read_text()
    with pytest.raises(UserError, match="--report-only"):  # new documents never join the older records
        fr.run_frontier(fr.FrontierConfig(**{**fc.__dict__, "n_per_task": 2}), log=lambda s: None, progress=False)
    other = fr.FrontierConfig(**{**fc.__dict__, "doc_len": 2048})
    with pytest.raises(UserError, match="another configuration"):
        fr.run_frontier(other, log=lambda s: None, progress=False, report_only=True)
    for p in (fill / "docs").glob("*.json"):  # a run of older records decoded with other settings
        p.write_text(json.dumps(json.loads(p.read_text()) | {"fingerprint": "0" * 16}))
    with pytest.raises(UserError, match="document 8: was written with settings other than this run's"):
        fr.run_frontier(fc, log=lambda s: None, progress=False, report_only=True, compare=str(fill))
