"""Per-step decode time is measured per decode forward, never by subtracting a separately timed prefill."""

from __future__ import annotations

import time

from flashmemory.eval.decode import full_run
from flashmemory.hf import HFEngine


def test_generate_times_each_decode_step():
    eng = HFEngine.from_name("micro")
    times: list[float] = []
    new = eng.generate(list(range(5, 45)), 4, step_times=times)
    assert len(new) == 4 and len(times) == 3 and all(t > 0 for t in times)


def test_full_run_step_time_survives_a_slow_prefill(monkeypatch):
    eng = HFEngine.from_name("micro")
    real = eng.generate

    def slow_prefill(prompt, n, resident=None, eos_token_id=None, step_times=None):
        time.sleep(0.3)  # a prefill far slower than the whole decode
        out = real(prompt, n)
        if step_times is not None:
            step_times.extend([0.002] * (len(out) - 1))
        return out

    monkeypatch.setattr(eng, "generate", slow_prefill)
    run = full_run(eng, "d", list(range(5, 45)), 5, (0, 1, 2), min_layers=1)
    assert abs(run.decode_step_s - 0.002) < 1e-12
