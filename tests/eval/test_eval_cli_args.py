"""`flashmemory eval`: numeric flags and checkpoint/dump sizes are checked before any scoring.

Each case protects README "Errors and data safety": *every numeric input is range-checked where it is read*
and *an expected failure prints one line naming the flag or file, with a non-zero exit* (no traceback, no
silently different run)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flashmemory.cli import main
from flashmemory.retriever.checkpoint import save_retriever


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--budgets", "2.5"], "--budgets '2.5': 2.5 is not a fraction in (0, 1]"),  # ran at 1.0, printed 2.5
        (["--budgets", "0.1,0"], "0 is not a fraction in (0, 1]"),
        (["--budgets", "0.1,nan"], "nan is not a fraction"),
        (["--budgets", "0.1,half"], "'half' is not a number"),
        (["--tau", "0"], "--tau 0: must be >= 1"),  # range() arg 3 must not be zero
        (["--stride", "-8"], "--stride -8: must be >= 0"),
        (["--threshold", "nan"], "--threshold nan: must lie in [0, 1]"),
        (["--decode", "--gen-tokens", "0"], "--gen-tokens 0: must be >= 1"),
        (["--residency", "--page-chunks", "0"], "--page-chunks 0: must be >= 1"),
        (["--decode", "--budget", "nan"], "--budget nan: must lie in (0, 1]"),
        (["--seed", str(2**64)], f"--seed {2**64}: must lie in [0, 2**32)"),  # was an overflow, no flag
    ],
)
def test_bad_numbers_are_one_line_before_any_work(synth, teacher, tmp_path, capsys, extra, msg) -> None:
    ck = save_retriever(teacher, tmp_path / "t.safetensors")
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
            *extra,
            "--json",
            str(out_json),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err == f"flashmemory eval: error: {err.split('error: ', 1)[1]}" and msg in err, err
    assert len(err.splitlines()) == 1 and not out_json.exists()


def test_zero_stride_means_tau_and_budgets_in_range_run(synth, teacher, tmp_path, capsys) -> None:
    """--stride 0 scores exactly the cycles (and results) of --stride tau, and fewer cycles than a smaller stride."""
    ck = save_retriever(teacher, tmp_path / "t.safetensors")

    def run(stride: int) -> tuple[dict, str]:
        out_json = tmp_path / f"r{stride}.json"
        capsys.readouterr()
        assert (
            main(
                [
                    "eval",
                    "--checkpoint",
                    str(ck),
                    "--dump",
                    str(synth / "train"),
                    "--stride",
                    str(stride),
                    "--tau",
                    "16",
                    "--budgets",
                    "1,0.5",
                    "--json",
                    str(out_json),
                ]
            )
            == 0
        )
        cycles_line = next(x for x in capsys.readouterr().out.splitlines() if " cycles, " in x)
        return json.loads(out_json.read_text())["results"], cycles_line

    zero, zero_line = run(0)
    assert set(zero) == {"fm@thr", "1", "0.5"}
    tau, tau_line = run(16)
    assert zero == tau and zero_line == tau_line
    finer, _ = run(8)
    assert finer["1"]["flashmemory"]["cycles"] > zero["1"]["flashmemory"]["cycles"] > 0


def test_a_checkpoint_of_another_hidden_size_is_named(synth, tmp_path, capsys) -> None:
    """A checkpoint whose hidden size differs from the dump's is one line naming both sizes and a document, before
    any scoring (not a `ValueError: hidden must be [B, 128]` from inside the scorer)."""
    from flashmemory.retriever.model import JointRetriever
    from flashmemory.train.synthetic import TEACHER_DIMS

    other = replace(TEACHER_DIMS, hidden=TEACHER_DIMS.hidden * 2)
    ck = save_retriever(JointRetriever((0, 1), other), tmp_path / "wide.safetensors")
    assert main(["eval", "--checkpoint", str(ck), "--dump", str(synth / "train"), "--stride", "8"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"flashmemory eval: error: {ck}: retriever hidden size {other.hidden}")
        and f"has hidden size {TEACHER_DIMS.hidden}" in err
        and "doc_" in err
        and len(err.splitlines()) == 1
    ), err
