"""Bench arguments are checked before any work, in one line with a non-zero exit: malformed or huge numbers,
counts below one, memory and disk the run would need, and a disk that fills up mid-run (never a table of
meaningless numbers). Every error line names the benchmark: `flashmemory bench NAME: error: ...`."""

from __future__ import annotations

import argparse

import pytest

from flashmemory.bench import guard, peers, tier
from flashmemory.cli import main
from flashmemory.offload.disk import FaultPlan, FaultyFileOps, PageStore

TINY = ["--pages", "2", "--conc", "1", "--layers", "4", "--reps", "1", "--device", "cpu"]


def _one_error_line(capsys, prefix: str) -> tuple[str, str]:
    """(stderr, stdout); stderr must be exactly one line starting with `prefix`."""
    got = capsys.readouterr()
    assert got.err.count("\n") == 1 and got.err.startswith(prefix) and "Traceback" not in got.err, got.err
    return got.err, got.out


@pytest.fixture
def no_servers(monkeypatch):
    """peers.run must stop before any work: building the model is the first step of the work."""
    import flashmemory.serve.stack as st

    def started(*_a):
        raise AssertionError("bench peers started work on bad arguments")

    monkeypatch.setattr(st, "ensure_model", started)


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["tier", "--pages", "1e9"], "--pages"),
        (["tier", "--pages", "99999999999999999999"], "--pages"),
        (["tier", "--step-ms", "inf"], "--step-ms"),
        (["tier", "--turnover", "nan"], "--turnover"),
        (["recall", "--chunks", "x"], "--chunks"),
        (["step", "--rows", "2.5"], "--rows"),
        (["peers", "--requests", "1" + "0" * 30], "--requests"),
    ],
)
def test_malformed_or_huge_numbers_are_argparse_lines(argv, flag, capsys, no_servers) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"flashmemory bench {argv[0]}: error: argument {flag}")


@pytest.mark.parametrize("contexts", ["2048,,4096", "1e4", "4096,99999999999", "-64"])
def test_peers_contexts_one_line_before_any_work(contexts, capsys, no_servers) -> None:
    p = argparse.ArgumentParser()
    peers.add_args(p)
    assert peers.run(p.parse_args(["--contexts", contexts])) == 2
    _one_error_line(capsys, "flashmemory bench peers: error: --contexts")


def test_peers_huge_counts_are_refused(capsys, no_servers) -> None:
    p = argparse.ArgumentParser()
    peers.add_args(p)
    assert peers.run(p.parse_args(["--requests", "100000"])) == 2
    _one_error_line(capsys, "flashmemory bench peers: error: --requests 100000")


def test_tier_memory_is_checked_before_allocating(capsys, monkeypatch) -> None:
    monkeypatch.setattr(guard, "available_memory", lambda: 10**8)  # 100 MB available
    allocated = []
    monkeypatch.setattr(tier, "measure", lambda args: allocated.append(args))
    assert main(["bench", "tier", "--pages", "4096", "--conc", "8", "--device", "cpu"]) == 2
    err, _ = _one_error_line(capsys, "flashmemory bench tier: error: --pages x --conc")
    assert "GB of host memory" in err and allocated == []


def test_tier_disk_space_is_checked_before_writing(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(guard.os, "statvfs", lambda _p: argparse.Namespace(f_bavail=10, f_frsize=4096))
    assert main(["bench", "tier", *TINY, "--dir", str(tmp_path)]) == 2
    _one_error_line(capsys, f"flashmemory bench tier: error: --dir {tmp_path}: needs about")


def test_tier_on_a_disk_that_fills_exits_non_zero_naming_dir(tmp_path, capsys, monkeypatch) -> None:
    def full_after_open(*a, **k):
        ops = FaultyFileOps(plan=FaultPlan())
        store = PageStore(*a, ops=ops, **k)
        ops.plan.full = True  # the store opened; every page write now meets a full disk
        return store

    monkeypatch.setattr(tier, "PageStore", full_after_open)
    assert main(["bench", "tier", *TINY, "--dir", str(tmp_path)]) == 2
    err, out = _one_error_line(capsys, f"flashmemory bench tier: error: --dir {tmp_path}: 2 of 2 pages")
    assert "disk full" in err and "GB/s" not in out


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["step", "--rows", "0"], "--rows"),
        (["recall", "--chunks", "0"], "--chunks"),
        (["train", "--batch-size", "0"], "--batch-size"),
        (["labels", "--tokens", "0"], "--tokens"),
        (["serve", "--requests", "-1"], "--requests"),
        (["tier", "--reps", "-1"], "--reps"),
        (["costmodel", "--disk-drives", "0"], "--disk-drives"),
    ],
)
def test_counts_below_one_are_argparse_lines(argv, flag, capsys) -> None:
    """Every int flag of a bench is a count: below 1 (below 0 where 0 is its default, "the run's default") it is
    refused by argparse before the bench starts (these ran with nonsense, or ended in a traceback)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"flashmemory bench {argv[0]}: error: argument {flag}: {argv[-1]}: must be >= "), err


def test_zero_keeps_meaning_the_runs_default_where_it_is_the_default() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    guard.guard_numbers(p)
    assert vars(p.parse_args(["--reps", "0", "--seed", "0"])) == {"reps": 0, "rows": 8, "seed": 0}
    with pytest.raises(SystemExit):
        p.parse_args(["--rows", "0"])


@pytest.mark.parametrize(
    "argv,prefix",
    [
        (["monitor", "--sizes", "a,b"], "flashmemory bench monitor: error: --sizes 'a,b'"),
        (["scorer", "--sizes", "x"], "flashmemory bench scorer: error: --sizes 'x'"),
        (["serve", "--contexts", "a,b"], "flashmemory bench serve: error: --contexts 'a,b'"),
        (["serve", "--contexts", "4096"], "flashmemory bench serve: error: --contexts '4096'"),
        (["serve", "--contexts", "4096,1024"], "flashmemory bench serve: error: --contexts '4096,1024'"),
        (["recall", "--plan-chunks", "1"], "flashmemory bench recall: error: --plan-chunks 1: too short"),
        (["recall", "--residency", "2"], "flashmemory bench recall: error: --residency 2.0: must lie in (0, 1]"),
        (
            ["recall", "--kmax", "99999999"],
            "flashmemory bench recall: error: --kmax 99999999 x --layers 21: needs about",
        ),
    ],
)
def test_bad_values_are_one_named_line_before_any_work(argv, prefix, capsys, no_servers) -> None:
    """Malformed lists and impossible sizes: one line naming the bench and the flag (these printed an unprefixed
    line to stdout, or ended in a traceback; recall's only after minutes of timing)."""
    assert main(["bench", *argv]) == 2
    _one_error_line(capsys, prefix)
