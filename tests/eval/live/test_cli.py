"""`flashmemory eval live`'s flags: --help, and bad input as one line naming the flag (no traceback)."""

from __future__ import annotations

import argparse

import pytest

from flashmemory.errors import UserError
from flashmemory.eval.live.cli import config_from_args, register_live


def _parse(argv):
    p = argparse.ArgumentParser()
    register_live(p.add_subparsers())
    return p.parse_args(["live", *argv])


def test_defaults_and_chunk_flags():
    cfg = config_from_args(_parse(["--arms", "stock,HiSparse", "--budgets", "0.1", "--max-docs", "3"]))
    assert [a.key for a in cfg.arms] == ["stock", "HiSparse@0.1"] and cfg.max_docs == 3 and cfg.hold_s == 600.0
    assert cfg.tasks == ("niah_single", "niah_multikey", "mqar") and cfg.n_per_task == 8
    assert config_from_args(_parse(["--report-only"])).max_docs == 0


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--arms", "Full"], "--arms: unknown Full"),
        (["--budgets", "0"], "--budgets"),
        (["--n-per-task", "0"], "--n-per-task 0"),
        (["--tasks", "nope"], "--tasks: unknown nope"),
        (["--server-env", "1BAD"], "--server-env '1BAD'"),
        (["--hold-minutes", "0"], "--hold-minutes 0"),
        (["--replay", "/no/such/run"], "--replay /no/such/run"),
    ],
)
def test_bad_flags_name_themselves(argv, msg):
    with pytest.raises(UserError, match=msg.replace("(", r"\(")):
        config_from_args(_parse(argv))


def test_help_mentions_the_lock(capsys):
    with pytest.raises(SystemExit):
        _parse(["--help"])
    out = capsys.readouterr().out
    assert "--lock" in out and "live-server lock" in out and "--max-docs" in out


def test_served_model_is_checked_with_the_window_the_servers_get(tmp_path, monkeypatch):
    import flashmemory.serve.model_check as mc
    from flashmemory.eval.live.cli import served_model

    seen = []
    monkeypatch.setattr(mc, "check_serving_model", lambda m, swa_window=0: seen.append(swa_window) or m)
    (tmp_path / "config.json").write_text("{}")
    served_model(tmp_path, {"SGLANG_FLASHMEMORY_CPU_SWA_WINDOW": "32"})
    served_model(tmp_path, {})
    assert seen == [32, 0]
    with pytest.raises(UserError, match="--server-env SGLANG_FLASHMEMORY_CPU_SWA_WINDOW=x"):
        served_model(tmp_path, {"SGLANG_FLASHMEMORY_CPU_SWA_WINDOW": "x"})


def test_flashmemory_eval_live_bad_flag_is_one_prefixed_line(capsys):
    from flashmemory.cli import main

    assert main(["eval", "live", "--arms", "Full", "--replay", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "flashmemory eval live: error: --arms: unknown Full; choose from stock, FlashMemory, HiSparse, "
        "HiSparse+prefetch"
    ]
