"""`flashmemory plan`: the 1M x 64 answer on 8xH20 with NVMe, a smaller node's first resource to run out, every
figure against the cost model's own functions and a hand-worked 1M case, and bad inputs as one-line errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from flashmemory.cli import main
from flashmemory.costmodel.anchors import capacity, kmax_for, tok_s
from flashmemory.costmodel.bytes import PolicyKnobs
from flashmemory.costmodel.disk import DiskKnobs, disk_point
from flashmemory.costmodel.plan import FmSettings, Plan, h20_node, plan, resolve_kmax

M1 = 1048576
TOKEN_POOL = "HBM token pool (per GPU)"


def _res(pl: Plan, prefix: str) -> int:
    return next(r.cap for r in pl.resources if r.name.startswith(prefix))


@pytest.fixture(scope="module")
def h20() -> Plan:
    return plan(h20_node(), DiskKnobs(), M1, 64)


def test_1m_x_64_on_h20_with_nvme_is_no_token_pool_first(h20: Plan) -> None:
    node = h20_node()
    assert not h20.fits
    assert h20.first_out is not None and h20.first_out.name == TOKEN_POOL
    assert (h20.first_out.cap, "token pool") == capacity(node, "disk", M1, kmax_for(M1))
    assert h20.first_out.need > h20.first_out.have  # 64 rows need more than the pool's budget
    assert h20.admitted == 41


def test_hand_worked_1m(h20: Plan) -> None:
    """KMAX 384 of 4,096 pages, Path-I: 21 c4 layers x 262,144 chunks x 584 B + 18 x 262,144 x 132 B per rank."""
    host = 21 * 262144 * 584 + 18 * 262144 * 132
    assert h20.kmax == 384 and h20.req.host == host == 3_837_788_160
    # token pool: 828 B per logical token (CREDIT_C4=1) plus the reserve row of 384 pages x 64 x 21 x 585 B
    hbm = {t.name: t for t in h20.tiers}["HBM (per GPU)"]
    assert hbm.bytes_per_request == 1_048_576 * 828 + 384 * 64 * 21 * 585 == 1_170_137_088
    # disk: one copy per rank, 4 x 7.68 TB x 0.9
    disk = {t.name: t for t in h20.tiers}["disk (node)"]
    assert disk.bytes_per_request == 8 * host
    assert disk.fits == _res(h20, "disk capacity") == 4 * 7.68e12 * 0.9 // (8 * host) == 900
    # landing window: 3 pages of host / 4,096 bytes per rank, 8 ranks
    win = 3 * host / 4096 * 8
    assert {t.name: t for t in h20.tiers}["host DRAM (node)"].bytes_per_request == win == 22_487_040
    usable = 2265e9 * h20.node.hw.host_fraction
    assert _res(h20, "host DRAM") == int(usable // win)
    hit = (usable - 64 * win) / (64 * 8 * host)
    assert h20.hit_rate == pytest.approx(hit, rel=1e-12)
    # per decode token of one request: the recall of 384 pages x 64 chunks x (21 x 584 + 18 x 132) B over tau 64
    host_moves = {t.name: t for t in h20.tiers}["host DRAM (node)"].moves
    assert host_moves["H2D recall per GPU link"] == 384 * 64 * (21 * 584 + 18 * 132) / 64 == 5_621_760
    assert host_moves["D2H write-back per GPU link"] == (21 * 584 + 18 * 132) / 4
    assert disk.moves["disk -> host read-ahead"] == pytest.approx(5_621_760 * 8 * (1 - hit), rel=1e-12)
    assert disk.moves["host -> disk write-behind"] == pytest.approx(8 * host * (1 - hit) / 8192, rel=1e-12)
    # the disk per cycle: reads at 4 x 6.5 x 0.8 GB/s, writes at 4 x 3.5 x 0.8 GB/s
    reads = 64 * 8 * 384 * 64 * (21 * 584 + 18 * 132) * (1 - hit)
    writes = 64 / 8192 * 64 * 8 * host * (1 - hit)
    assert h20.point.disk_ms_cycle == pytest.approx(1e3 * (reads / 20.8e9 + writes / 11.2e9), rel=1e-9)


def test_figures_are_the_cost_models(h20: Plan) -> None:
    node = h20_node()
    hit = h20.hit_rate
    pt = disk_point(M1, 384, 64, node.hw, DiskKnobs(hit_rate=hit), PolicyKnobs(path_i=True), pool_cap=41)
    assert dataclasses.asdict(h20.point) == dataclasses.asdict(pt)
    # the disk-bandwidth cap is the last concurrency whose disk time lands within tau x step
    bw = _res(h20, "disk bandwidth")
    usable = 2265e9 * node.hw.host_fraction

    def share(c: int) -> float:
        h = min(1.0, (usable - c * 3 * h20.req.host / 4096 * 8) / (c * 8 * h20.req.host))
        return disk_point(
            M1, 384, c, node.hw, DiskKnobs(hit_rate=h), PolicyKnobs(path_i=True), pool_cap=41
        ).window_share

    assert 1 <= bw < 64 and share(bw) <= 1.0 < share(bw + 1)
    # at the 41 admitted the disk keeps up: tok/s is FlashMemory's from DRAM (the projection's disk row)
    assert h20.tok_s_admitted == pytest.approx(tok_s(node, "flashmemory", M1, 41, 384), rel=1e-12)
    # without disks host DRAM holds every rank's mirror: the calibrated ceiling of 40, 'host DRAM'
    dram = plan(node, None, M1, 64)
    assert dram.first_out is not None and (dram.admitted, dram.first_out.name.startswith("host DRAM")) == (40, True)
    assert (_res(dram, "host DRAM"), "host DRAM") == capacity(node, "flashmemory", M1, 384)
    assert len(dram.tiers) == 2 and dram.point.read_gb_cycle == 0.0
    # CREDIT_C4=0: the pool admits what stock's does
    nocredit = plan(node, DiskKnobs(), M1, 64, FmSettings(credit_c4=False))
    assert _res(nocredit, TOKEN_POOL) == capacity(node, "stock", M1)[0] == 11


def test_settings_change_the_terms() -> None:
    node = h20_node()
    base = plan(node, DiskKnobs(), M1, 32)
    half = plan(node, DiskKnobs(), M1, 32, FmSettings(tau=32))
    key = "H2D recall per GPU link"
    assert half.tiers[1].moves[key] == 2 * base.tiers[1].moves[key]
    assert half.point.window_ms < base.point.window_ms
    assert resolve_kmax(M1, FmSettings()) == kmax_for(M1) == 384
    assert resolve_kmax(262144, FmSettings(budget_share=0.1)) == math.ceil(0.1 * 1024) == 103
    assert plan(node, DiskKnobs(), 262144, 8, FmSettings(kmax=7)).kmax == 7
    shared = plan(node, DiskKnobs(copies=1), M1, 64)
    assert shared.tiers[2].bytes_per_request == shared.req.host


@pytest.mark.parametrize(
    "flags, first, cap",
    [
        (["--disks", "0", "--host-ram-gb", "1024"], "host DRAM (node, full mirrors)", 18),  # 562 GB / 30.7 GB
        (
            ["--disks", "1", "--disk-tb", "1.92", "--hit-rate", "0.99", "--mem-fraction", "sglang"],
            "disk capacity (node)",
            56,
        ),  # 1.73 TB / 30.7 GB
        (["--disks", "1", "--mem-fraction", "sglang"], "disk bandwidth", None),
        (["--hbm-gb", "80"], TOKEN_POOL, None),
    ],
)
def test_smaller_node_names_what_runs_out_first(
    flags: list[str], first: str, cap: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["projected"] is True and out["answer"] is False
    assert out["first_out"].startswith(first)
    short = [r for r in out["resources"] if r["short"]]
    lowest = min(short, key=lambda r: r["cap"])
    assert lowest["name"] == out["first_out"] and (cap is None or lowest["cap"] == cap)
    assert f"First to run out: {out['first_out']}: holds {lowest['cap']} of 64" in out["verdict"]


def test_report_shows_inputs_and_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROJECTED by the cost model")
    for text in (
        "8 GPUs x 102.6 GB",
        "4 x 7.68 TB",
        "KMAX 384",
        "CREDIT_C4=1",
        "tau 64",
        "holds      41",
        "does NOT keep up",
        "1M x 64 on 8xH20 with 4 NVMe: NO (projected). First to run out: HBM token pool (per GPU): holds 41 of 64",
        "at 41 (the most every resource allows): 1,428 tok/s",
    ):
        assert text in out, text
    assert main(["plan", "--context", "256K"]) == 0
    assert "256K x 64 on 8xH20 with 4 NVMe: YES" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, msg",
    [
        (["--gpus", "0"], "--gpus 0: must be > 0"),
        (["--budget-share", "1.5"], "--budget-share 1.5: must be in (0, 1]"),
        (["--hit-rate", "-0.1"], "--hit-rate -0.1: must be in [0, 1]"),
        (["--kmax", "4097"], "--kmax 4097: must be in [1, 4096]"),
        (["--disks", "-2"], "--disks -2: must be >= 0"),
        (["--mem-fraction", "0"], "--mem-fraction 0.0: must be in (0, 1]"),
        (["--overhead-ms", "-1"], "--overhead-ms -1.0: must be >= 0"),
        (["--concurrency", "0"], "--concurrency 0: must be > 0"),
        (["--context", "2"], "--context 2: must be >= 4 tokens"),
    ],
)
def test_bad_input_is_one_line(flags: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flashmemory plan: error: {msg}") and "\n" not in err and "Traceback" not in err


def test_bad_context_and_settings() -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--context", "1X"])
    with pytest.raises(ValueError, match="tau"):
        FmSettings(tau=0)
    with pytest.raises(ValueError, match="KMAX 2000 exceeds"):
        plan(h20_node(), None, 262144, 1, FmSettings(kmax=2000))
