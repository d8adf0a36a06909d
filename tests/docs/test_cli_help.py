"""Every `flashmemory ... --help` renders as text, and `flashmemory serve` fails in the `flashmemory <cmd>: error:`
form the other commands use."""

from __future__ import annotations

import argparse
import re
import signal
from pathlib import Path

import pytest

from flashmemory.cli import build_parser, main


def all_parsers(p: argparse.ArgumentParser, chain: str = "flashmemory"):
    yield chain, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from all_parsers(sub, f"{chain} {name}")


def test_every_help_renders_as_text() -> None:
    seen = 0
    for chain, p in all_parsers(build_parser()):
        text = p.format_help()
        assert "'option_strings'" not in text and "{'" not in text, f"`{chain} --help` prints a raw dict"
        assert not re.search(r"\b[Ii]ssues? \d+", text), f"`{chain} --help` names a project issue"
        seen += 1
    assert seen > 20


def test_bench_help_lists_every_benchmark_readably(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "~10% residency" in out and "'prog'" not in out


@pytest.fixture
def keep_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_serve_bad_ckpt_is_one_prefixed_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_signals) -> None:
    assert main(["serve", "--ckpt", str(tmp_path / "nope.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashmemory serve: error: --ckpt "), err


def test_serve_start_failure_ends_in_a_prefixed_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, keep_signals
) -> None:
    import flashmemory.serve.stack as stack
    from flashmemory.serve.procs import ServerStartError

    def refuse(servers, cfg, router_port=None):
        raise ServerStartError(
            f"decode exited with 2 before http://127.0.0.1:1/health answered; log {tmp_path}/d.log:"
            "\nerror: MODEL=/x does not exist"
        )

    monkeypatch.setattr(stack, "ensure_model", lambda p: p)
    monkeypatch.setattr(stack, "start_pd", refuse)
    rc = main(["serve", "--ckpt", "none", "--model", str(tmp_path), "--logs", str(tmp_path / "logs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[0] == "error: MODEL=/x does not exist"  # the server's log tail first
    assert err[-1].startswith("flashmemory serve: error: decode exited with 2"), err


def test_every_bench_fails_in_one_form_naming_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flashmemory bench NAME: error: ...` for an expected failure of any benchmark, also under `bench all`
    (a UserError read `flashmemory bench: error: ...`, and `bench tier` then repeated its own name in it)."""
    import importlib

    from flashmemory.bench.cli import available
    from flashmemory.errors import UserError

    def refuse(args):
        raise UserError("--flag 7: bad")

    names = list(available())
    for mod, _ in available().values():
        monkeypatch.setattr(importlib.import_module(mod), "run", refuse)
    for name in names:
        assert main(["bench", name]) == 2
        assert capsys.readouterr().err == f"flashmemory bench {name}: error: --flag 7: bad\n"
    assert main(["bench", "all", "--quick"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"flashmemory bench {name}: error: --flag 7: bad" for name in names]


def test_bench_messages_do_not_name_the_bench_again() -> None:
    """The bench's name comes from the one place that prints the line; a message that starts with it again
    reads `flashmemory bench tier: error: bench tier: ...`."""
    root = Path(__file__).resolve().parents[2] / "flashmemory" / "bench"
    bad = [
        f"{p.name}:{i}"
        for p in sorted(root.glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"""(UserError|require_memory|require_disk)\(f?["']bench """, line)
        or re.search(r"""\bfail\(["']bench["']""", line)
    ]
    assert bad == []


def test_an_unknown_flag_is_named_by_the_command_it_was_given_to(capsys: pytest.CaptureFixture[str]) -> None:
    """`flashmemory demo --nope` reads `flashmemory demo: error: ...`, for every (sub)command (argparse named
    them all `flashmemory: error: unrecognized arguments`)."""
    seen = 0
    for chain, _ in all_parsers(build_parser()):
        with pytest.raises(SystemExit) as e:
            main([*chain.split()[1:], "--no-such-flag"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err and err[-1].startswith(f"{chain}: error: "), (chain, err[-1:])
        seen += 1
    assert seen > 20


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_serve_model_that_cannot_be_built_names_the_flag(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str], keep_signals
) -> None:
    """A --model with no model that cannot be built either: one line naming the flag (a parent that is a file
    named a lock file; a file in its place ended in a traceback)."""
    (tmp_path / "file").write_text("")
    model = tmp_path / "file" / "model" if where == "under_a_file" else tmp_path / "file"
    assert main(["serve", "--ckpt", "none", "--model", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flashmemory serve: error: --model {model}: "), err


@pytest.mark.parametrize("parent", ["missing", "file"])
def test_train_tiny_on_an_unusable_out_dir_is_one_line_naming_it(
    tmp_path: Path, parent: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The OS's error as `PATH: cause` under train-tiny's own prefix (it printed Python's `[Errno 2] ...`, and a
    parent that is a file escaped as `flashmemory model: error:`)."""
    if parent == "file":
        (tmp_path / "file").write_text("")
    out = tmp_path / parent / "run" if parent == "file" else Path("/proc") / "no-such-run"
    assert main(["model", "train-tiny", "--out-dir", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flashmemory model train-tiny: error: {out}: "), err
    assert "[Errno" not in err[0]


@pytest.mark.parametrize(
    "argv,prefix",
    [
        (["checkpoint", "inspect", "/no/such.safetensors"], "flashmemory checkpoint inspect: error: /no/such"),
        (["checkpoint", "convert", "/no/such.pt", "x.pt"], "flashmemory checkpoint convert: error: x.pt"),
        (["model", "build-serving", "--out", "{file}/model"], "flashmemory model build-serving: error: "),
    ],
)
def test_an_error_is_named_by_the_whole_subcommand(
    argv, prefix, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One form for every command: the error line names the subcommand that failed (these read
    `flashmemory checkpoint: error:` and `flashmemory model: error:`)."""
    (tmp_path / "file").write_text("")
    assert main([a.format(file=tmp_path / "file") for a in argv]) in (1, 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix), err
