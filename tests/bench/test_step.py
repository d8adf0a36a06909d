"""`flashmemory bench step` runs both adapters on the same pool and prints their ratio (no timing asserted)."""

import argparse

from flashmemory.bench import step


def test_step_bench_runs_both_modes(capsys):
    p = argparse.ArgumentParser()
    step.add_args(p)
    assert step.run(p.parse_args(["--quick", "--layers", "4"])) == 0
    out = capsys.readouterr().out
    assert "16 requests" in out and "\ncopy " in out and "\nshrink " in out and "shrink / copy (mean):" in out
