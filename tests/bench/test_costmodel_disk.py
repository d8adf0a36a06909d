"""The disk arm of the cost model: its arithmetic by hand, the direction it moves with bandwidth,
concurrency and turnover, the >= 64 x 1M verdict agreeing with the points, and its table in `bench costmodel`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flashmemory.cli import main
from flashmemory.costmodel import Hardware, PolicyKnobs, flashmemory_bytes, flashmemory_flops
from flashmemory.costmodel.disk import DiskKnobs, disk_point, max_conc_within
from flashmemory.costmodel.throughput import capacity, step_time

CTX, KMAX = 1048576, 384
HW = dataclasses.replace(Hardware(), overhead_ms=20.0)
PK = PolicyKnobs(path_i=True)


def test_point_by_hand() -> None:
    # concurrency 80 and the Level-1 interval 64 differ, so a formula that swapped them would not pass
    conc, interval = 80, 64
    dk = DiskKnobs()
    p = disk_point(CTX, KMAX, conc, HW, dk, PK)
    req = flashmemory_bytes(CTX, KMAX, PK)
    copies = HW.n_gpus
    cache = HW.host_ram_gb * 1e9 * HW.host_fraction
    hit = min(1.0, cache / (conc * req.host * copies))
    reads = conc * copies * req.recall_cycle * (1 - hit)
    writes = conc / dk.output_tokens * interval * req.host * copies * (1 - hit)
    disk_s = reads / (4 * 6.5e9 * 0.8) + writes / (4 * 3.5e9 * 0.8)
    st = step_time(conc, req, flashmemory_flops(CTX, KMAX).total, HW)[0]
    assert p.hit_rate == pytest.approx(hit) and p.read_gb_cycle == pytest.approx(reads / 1e9)
    assert p.write_gb_cycle == pytest.approx(writes / 1e9)
    assert p.disk_ms_cycle == pytest.approx(disk_s * 1e3) and p.window_ms == pytest.approx(interval * st * 1e3)
    assert p.step_ms == pytest.approx(max(st, disk_s / interval) * 1e3)
    assert p.tok_s_dram == pytest.approx(conc / st)
    assert p.tok_s == pytest.approx(conc / max(st, disk_s / interval))
    assert p.loss == pytest.approx(1 - st / max(st, disk_s / interval))
    assert p.dram_cap == capacity(req, HW)[1] and p.dram_fits == (conc <= p.dram_cap)
    assert 0 < hit < 1 and p.fits and p.loss > 0


def test_all_in_cache_costs_nothing_and_more_bandwidth_never_hurts() -> None:
    p = disk_point(CTX, KMAX, 64, HW, DiskKnobs(hit_rate=1.0), PK)
    assert p.read_gb_cycle == 0 and p.write_gb_cycle == 0 and p.loss == 0 and p.tok_s == p.tok_s_dram
    losses = [disk_point(CTX, KMAX, c, HW, DiskKnobs(), PK).loss for c in (32, 64, 80, 96)]
    assert losses == sorted(losses)
    base = max_conc_within(CTX, KMAX, HW, DiskKnobs(), 0.10, PK)
    assert max_conc_within(CTX, KMAX, HW, DiskKnobs(drives=8), 0.10, PK) >= base
    assert max_conc_within(CTX, KMAX, HW, DiskKnobs(), 0.10, PolicyKnobs(path_i=True, turnover=0.5)) >= base
    assert max_conc_within(CTX, KMAX, HW, DiskKnobs(copies=1), 0.10, PK) >= base
    assert disk_point(CTX, KMAX, 64, HW, DiskKnobs(drive_tb=0.01), PK).fits is False  # disk capacity binds


def test_verdict_agrees_with_the_points() -> None:
    for dk, pk in ((DiskKnobs(), PK), (DiskKnobs(), PolicyKnobs(path_i=True, turnover=0.5)), (DiskKnobs(drives=1), PK)):
        best = max_conc_within(CTX, KMAX, HW, dk, 0.10, pk)
        assert best >= 1
        assert disk_point(CTX, KMAX, best, HW, dk, pk).loss <= 0.10
        nxt = disk_point(CTX, KMAX, best + 1, HW, dk, pk)
        assert nxt.loss > 0.10 or not nxt.fits


def test_token_pool_cap_replaces_the_hbm_bound() -> None:
    free = disk_point(CTX, KMAX, 42, HW, DiskKnobs(), PK)
    capped = disk_point(CTX, KMAX, 42, HW, DiskKnobs(), PK, pool_cap=41)
    assert free.fits and not capped.fits and capped.bound == "token pool"
    assert capped.tok_s == free.tok_s  # the cap decides admission only, not the step
    assert disk_point(CTX, KMAX, 41, HW, DiskKnobs(), PK, pool_cap=41).fits
    assert max_conc_within(CTX, KMAX, HW, DiskKnobs(), 0.10, PK, pool_cap=41) <= 41


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"drives": 0}, "drives"),
        ({"read_gbps": float("nan")}, "read_gbps"),
        ({"efficiency": 1.5}, "efficiency"),
        ({"copies": 0}, "copies"),
        ({"hit_rate": -0.1}, "hit_rate"),
        ({"output_tokens": 0}, "output_tokens"),
    ],
)
def test_bad_knobs_are_named(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"DiskKnobs.{field}"):
        DiskKnobs(**kw)


def test_bench_costmodel_prints_the_disk_table(tmp_path, capsys) -> None:
    out = tmp_path / "cm.json"
    assert main(["bench", "costmodel", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "DISK TIER ESTIMATE (not measured)" in text and ">= 64 concurrent 1M requests at <= 10% loss" in text
    d = json.loads(out.read_text())["disk"]
    assert d["ctx"] == CTX and d["kmax"] == KMAX and len(d["scenarios"]) == 3
    for v in d["scenarios"].values():
        assert [p["conc"] for p in v["points"]] == [32, 51, 64, 80, 96]
        verdict = "YES" if v["max_conc_within_10pct"] >= 64 else "NO"
        assert f"at <= 10% loss: {verdict} (up to {v['max_conc_within_10pct']};" in text
    with pytest.raises(SystemExit) as e:  # a count flag: argparse's own line, before any work
        main(["bench", "costmodel", "--disk-drives", "0"])
    assert e.value.code == 2
    assert "flashmemory bench costmodel: error: argument --disk-drives: 0: must be >= 1" in capsys.readouterr().err
