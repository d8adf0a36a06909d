"""The HiSparse + prefetch arm of the cost model: it reduces to HiSparse with nothing prefetched, moves demand
bytes off the critical path as coverage grows, is bounded by the PCIe link, and changes nothing on the fast path."""

from __future__ import annotations

import pytest

from flashmemory.costmodel.admission import tok_s
from flashmemory.costmodel.anchors import calibrated, calibrated_hisparse, fit
from flashmemory.costmodel.hisparse import HiSparseKnobs
from flashmemory.costmodel.hisparse_prefetch import (
    CONTEXTS,
    COVERAGES,
    HIT_RATES,
    PrefetchKnobs,
    prefetch_step,
    projection,
    table,
)
from flashmemory.costmodel.presets import H20_NODE

F = fit()
P = calibrated(H20_NODE, F, fitted_memory=True)


def test_no_coverage_and_no_level1_is_hisparse_itself():
    hs = calibrated_hisparse(F, hit_rate=0.7)
    for ctx, batch in ((131072, 64), (1048576, 8)):
        r = prefetch_step(P, ctx, batch, hs, PrefetchKnobs(coverage=0.0, level1=False))
        assert r.prefetch_ms == pytest.approx(r.hisparse_ms)
        assert r.hisparse_ms == pytest.approx(1e3 * batch / tok_s(P, "hisparse", ctx, batch, 1, hs))
        assert r.demand_bytes == r.hisparse_demand_bytes and r.prefetch_bytes == 0


def test_coverage_moves_demand_bytes_off_the_critical_path():
    hs = calibrated_hisparse(F, hit_rate=0.6)
    steps = [prefetch_step(P, 262144, 32, hs, PrefetchKnobs(c, 1.0, level1=False)) for c in (0.0, 0.5, 1.0)]
    assert [s.demand_bytes for s in steps] == pytest.approx([steps[0].hisparse_demand_bytes * f for f in (1, 0.5, 0)])
    assert steps[0].prefetch_ms > steps[1].prefetch_ms > steps[2].prefetch_ms
    assert steps[2].prefetch_bytes == pytest.approx(steps[0].demand_bytes)


def test_a_saturated_link_stretches_the_step():
    hs = HiSparseKnobs(hit_rate=0.0)
    slow = prefetch_step(P, 1048576, 128, hs, PrefetchKnobs(0.9, 0.01, level1=False))
    assert slow.link_bound and slow.prefetch_ms > slow.hisparse_ms


def test_fast_path_moves_nothing():
    r = prefetch_step(P, 8192, 16, HiSparseKnobs(), PrefetchKnobs(0.9, 0.5, level1=False))
    assert r.hisparse_demand_bytes == 0 and r.prefetch_bytes == 0 and r.prefetch_ms == pytest.approx(r.hisparse_ms)


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="coverage"):
        PrefetchKnobs(coverage=1.5)
    with pytest.raises(ValueError, match="precision"):
        PrefetchKnobs(precision=0.0)


def test_projection_table_has_one_row_per_case():
    rows = projection()
    assert len(rows) == len(CONTEXTS) * len(HIT_RATES) * len(COVERAGES)
    assert table(rows).count("\n") == len(rows) + 1


def test_readme_paragraph_quotes_the_model():
    """The README's HiSparse + prefetch numbers are `projection()`'s (regenerate both together)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    para = readme[readme.index("**HiSparse + prefetch, an exact mode.**") :]
    para = " ".join(para[: para.index("\n\n")].split())
    rows = {
        (r.ctx, h, c): r
        for r, (h, c) in zip(projection(), [(h, c) for _ in CONTEXTS for h in HIT_RATES for c in COVERAGES])
    }
    k128, k1m = 131072, 1048576
    assert f"0.95 hit rate it gains {rows[(k128, 0.95, 0.5)].speedup:.2f}x at 128K" in para
    r = rows[(k128, 0.68, 0.9)]
    assert f"{r.speedup:.2f}x at 128K ({r.hisparse_ms:.1f} -> {r.prefetch_ms:.1f} ms)" in para
    assert f"and {rows[(k1m, 0.68, 0.9)].speedup:.2f}x at 1M" in para


def test_module_parses_its_arguments(capsys):
    from flashmemory.costmodel.hisparse_prefetch import main

    assert main(["--hit-rates", "0.68", "--coverages", "0.9"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 0.68 | 0.9 |") == len(CONTEXTS) and "| 0.95 |" not in out
    for bad in (["--bogus"], ["--hit-rates", "1.5"], ["--precision", "0.5,0.6"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "python -m flashmemory.costmodel.hisparse_prefetch: error:" in err
