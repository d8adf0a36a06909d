"""`flashmemory plan`: the 1M x 64 answer on 8xH20 with NVMe, a smaller node's first resource to run out, every
figure against the cost model's own functions and a hand-worked 1M case, and bad inputs as one-line errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from flashmemory.cli import main
from flashmemory.costmodel.admission import tok_s
from flashmemory.costmodel.bytes import PolicyKnobs
from flashmemory.costmodel.disk import DiskKnobs, disk_point
from flashmemory.costmodel.plan import FmSettings, Plan, h20_node, plan, resolve_kmax
from flashmemory.costmodel.projections import auto_ratio_capacity, kmax_for

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
    assert h20.first_out.need > h20.first_out.have  # 64 rows need more than the pool holds
    assert h20.admitted == 34
    # the same launch sized for what it admits (TGT_CONC 40 instead of 64: a smaller reserve) holds 40
    assert auto_ratio_capacity(node, "disk", M1, kmax_for(M1))[1] == 42 > h20.admitted


def test_hand_worked_1m(h20: Plan) -> None:
    """KMAX 384 of 4,096 pages, Path-I: 21 c4 layers x 262,144 chunks x 584 B + 18 x 262,144 x 132 B per rank."""
    host = 21 * 262144 * 584 + 18 * 262144 * 132
    assert h20.kmax == 384 and h20.req.host == host == 3_837_788_160
    # the reserve for TGT_CONC 64: 64 x 385 + 128 x 8 + 1 blocks of 21 c4 pages + 18 index pages, taken off
    # sglang's 0.895
    reserve = (64 * 385 + 1025) * (21 * 37440 + 18 * 8448)
    assert reserve == 24_081_572_160
    assert h20.pools.mem_fraction == pytest.approx(0.895 - reserve / (97871 * 2**20))
    # token pool: 828 B of c4 index keys and c128 + ratio x 31,875 B of SWA per full token; a request holds its
    # 1,048,576 tokens + 1,024 reserved decode tokens
    weights = 285_423_173_632 / 8  # FP8 experts
    avail = 97871 * 2**20 * h20.pools.mem_fraction - weights
    ratio = float(h20.resources[1].name.split("ratio ")[1].rstrip(")"))
    fixed = 1_373_634_560  # c128 compress state: 129 request slots x 128 rows (+129, to 128) x 4 KB x 20 layers
    assert h20.pools.fixed == fixed == math.ceil((129 * 128 + 129) / 128) * 128 * 4096 * 20
    full = int((avail - fixed) / (828 + ratio * 31875)) // 256 * 256
    assert h20.pools.full_tokens == full and h20.resources[0].cap == full // 1_049_600 == 34
    assert h20.pools.swa_tokens == int(full * ratio) // 256 * 256
    assert h20.resources[0].need == 64 * 1_049_600
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
    pt = disk_point(M1, 384, 64, node.hw, DiskKnobs(hit_rate=hit), PolicyKnobs(path_i=True), pool_cap=34)
    assert dataclasses.asdict(h20.point) == dataclasses.asdict(pt)
    # the disk-bandwidth cap is the last concurrency whose disk time lands within tau x step
    bw = _res(h20, "disk bandwidth")
    usable = 2265e9 * node.hw.host_fraction

    def share(c: int) -> float:
        h = min(1.0, (usable - c * 3 * h20.req.host / 4096 * 8) / (c * 8 * h20.req.host))
        return disk_point(
            M1, 384, c, node.hw, DiskKnobs(hit_rate=h), PolicyKnobs(path_i=True), pool_cap=34
        ).window_share

    assert 1 <= bw < 64 and share(bw) <= 1.0 < share(bw + 1)
    # at the 34 admitted the disk keeps up: tok/s is FlashMemory's from DRAM (the projection's disk row)
    assert h20.tok_s_admitted == pytest.approx(tok_s(node, "flashmemory", M1, 34, 384), rel=1e-12)
    # without disks host DRAM holds every rank's mirror: the calibrated ceiling of 40, 'host DRAM'
    dram = plan(node, None, M1, 64)
    assert _res(dram, "host DRAM") == 40 and dram.admitted == 34
    assert (_res(dram, "host DRAM"), "host DRAM") == auto_ratio_capacity(node, "flashmemory", M1, 384)[1:]
    assert len(dram.tiers) == 2 and dram.point.read_gb_cycle == 0.0
    # CREDIT_C4=0: the pool admits what stock's does at the same (smallest) SWA ratio
    nocredit = plan(node, DiskKnobs(), M1, 64, FmSettings(credit_c4=False))
    assert _res(nocredit, TOKEN_POOL) == auto_ratio_capacity(node, "stock", M1)[1] == 13
    # at sglang's ratio 0.1 it is stock's 7
    assert _res(plan(node, None, M1, 64, FmSettings(credit_c4=False), swa_ratio=0.1), TOKEN_POOL) == 7


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
            ["--disks", "1", "--disk-tb", "0.96", "--hit-rate", "0.99"],
            "disk capacity (node)",
            28,
        ),  # 864 GB / 30.7 GB
        (["--disks", "1", "--host-ram-gb", "256"], "disk bandwidth", 7),
        (["--hbm-gb", "80"], TOKEN_POOL, None),
        (["--context", "512K", "--swa-ratio", "0.1"], TOKEN_POOL, None),
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
        "FP8 experts; --mem-fraction-static 0.660 (sglang's default, lowered by the reserve)",
        "HBM SWA pool (per GPU, ratio 0.00084)",
        "does NOT keep up",
        "1M x 64 on 8xH20 with 4 NVMe: NO (projected). First to run out: HBM token pool (per GPU): holds 34 of 64",
        "at 34 (the most every resource allows): 1,121 tok/s",
        "stock admits 13 (token pool), HiSparse 21 (token pool) requests of 1M",
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
        (["--context", "2M"], "--context 2097152: must be <= 1,048,576"),
        (["--hbm-gb", "1e300"], "--hbm-gb 1e+300: must be <= 10,000"),
        (["--gpus", "6"], "--gpus 6: must be a divisor of 64"),
        (["--dp", "3"], "--dp 3: must be a divisor of --gpus 8"),
        (["--swa-ratio", "0"], "--swa-ratio 0.0: must be in (0, 1]"),
        (["--gpus", "1"], "no HBM left for KV: --mem-fraction-static 0.660 (after the reserve)"),
        (["--gpus", "2", "--concurrency", "8"], "no HBM left for KV: --mem-fraction-static"),
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


def test_attention_dp_holds_kv_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """--dp 8 (attention DP on 8 GPUs): each rank holds only its own requests' KV, so 1M x 64 fits; stock and
    HiSparse are projected beside it, and the note says FlashMemory under DP attention is run on CPU only."""
    tp, dp = plan(h20_node(), DiskKnobs(), M1, 64), None
    assert main(["plan", "--json", "--dp", "8"]) == 0
    dp = json.loads(capsys.readouterr().out)
    assert dp["answer"] is True and not tp.fits
    pool = next(r for r in dp["resources"] if r["name"] == TOKEN_POOL)
    assert pool["cap"] >= 8 * 8 and pool["need"] == 8 * 1_049_600  # 64 / 8 requests per rank
    assert dp["peers"]["stock"]["admitted"] > 64 > tp.admitted  # stock too: the replication was the bound
    assert main(["plan", "--dp", "8"]) == 0
    assert "attention DP 8: each rank holds only its own requests' KV" in capsys.readouterr().out


def test_help_offers_the_pool_and_dp_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--dp", "--enable-dp-attention", "--swa-ratio", "--experts", "what launch_decode.sh passes"):
        assert text in out, text
