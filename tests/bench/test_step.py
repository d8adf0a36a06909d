"""`flashmemory bench step` prints host time and blocking operations per decode step for every mode beside the
adapter off (no timing asserted)."""

import argparse

from flashmemory.bench import step


def test_step_bench_prints_every_mode_beside_the_adapter_off(capsys):
    p = argparse.ArgumentParser()
    step.add_args(p)
    assert step.run(p.parse_args(["--quick", "--steps", "4"])) == 0
    out = capsys.readouterr().out
    assert "8 requests" in out and "blocking/step" in out and "x off" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert set(rows) == set(step.MODES)
    assert float(rows["off"][3]) == 0.0  # stock hooks: nothing to wait for
    assert float(rows["copy"][6]) > 0  # the admitting step's listed reads are counted


def test_step_bench_admits_a_burst_a_warm_start_budget_per_step(capsys):
    """8 arrivals of 8 pages (7 warm pages each, budget 16): stock sglang admits all 8 at the first step; the
    queue's gate admits 2 a step in either mode, so the queue empties over 4 steps."""
    p = argparse.ArgumentParser()
    step.add_args(p)
    assert step.run(p.parse_args(["--rows", "8", "--history", "2048", "--steps", "4", "--layers", "2"])) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert [rows["off"][7], rows["off"][8]] == ["8", "1"]
    for mode in ("copy", "shrink", "shrink-tp2"):
        assert [rows[mode][7], rows[mode][8]] == ["2", "4"], rows[mode]
        assert float(rows[mode][10]) == 0.0  # the step after the queue emptied (it settles a chunk): no wait
