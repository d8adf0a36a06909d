"""`flashmemory eval` on a synthetic dump: the table, the JSON, and the oracle/teacher ordering."""

from __future__ import annotations

import json

from flashmemory.cli import main
from flashmemory.retriever.checkpoint import save_retriever


def test_eval_cli_prints_table_and_json(synth, teacher, tmp_path, capsys) -> None:
    ck = save_retriever(teacher, tmp_path / "teacher.safetensors")
    out_json = tmp_path / "r.json"
    rc = main(
        [
            "eval",
            "--checkpoint",
            str(ck),
            "--dump",
            str(synth / "train"),
            "--stride",
            "8",
            "--budgets",
            "0.1,0.25",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    for p in ("flashmemory", "recency", "random", "reactive", "oracle"):
        assert p in out
    res = json.loads(out_json.read_text())["results"]
    assert set(res) == {"fm@thr", "0.1", "0.25"}
    for b, pol in res.items():
        fracs = {round(m["resident_frac"], 6) for p, m in pol.items() if b != "fm@thr" or p != "oracle"}
        assert len(fracs) == 1  # equal budgets
        assert pol["oracle"]["golden_recall"] >= max(m["golden_recall"] for m in pol.values()) - 1e-9
    # The teacher made the labels, so at a 25% budget it beats recency and random.
    r = res["0.25"]
    assert r["flashmemory"]["golden_recall"] > max(r["recency"]["golden_recall"], r["random"]["golden_recall"])
    assert r["flashmemory"]["mass_steps"] > 0


def test_eval_rejects_missing_layers(synth, tmp_path, capsys) -> None:
    from flashmemory.retriever.model import JointRetriever
    from flashmemory.train.synthetic import TEACHER_DIMS

    ck = save_retriever(JointRetriever((5,), TEACHER_DIMS), tmp_path / "x.safetensors")
    assert main(["eval", "--checkpoint", str(ck), "--dump", str(synth / "train")]) == 2
    assert "layers [5]" in capsys.readouterr().err


def test_eval_refuses_a_nan_checkpoint(synth, teacher, tmp_path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    ck = save_retriever(teacher, tmp_path / "t.safetensors")
    sd = load_file(str(ck))
    key = sorted(sd)[0]
    sd[key].view(-1)[0] = float("nan")
    save_file(sd, str(tmp_path / "nan.safetensors"))
    assert main(["eval", "--checkpoint", str(tmp_path / "nan.safetensors"), "--dump", str(synth / "train")]) == 2
    err = capsys.readouterr().err
    assert f"nan.safetensors: {key} holds 1 non-finite value(s)" in err and len(err.splitlines()) == 1
