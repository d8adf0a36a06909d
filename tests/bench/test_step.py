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
