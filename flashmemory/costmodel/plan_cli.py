"""`flashmemory plan`: can a decode node serve N requests of a given context with FlashMemory and a disk tier?
Prints the inputs, each tier's requests and bytes, the bytes moved per token, whether the disks keep up, the
projected tok/s and the answer (which resource runs out first and by how much). All of it is the cost model's
projection (`flashmemory.costmodel.plan`); nothing is measured. `--json` prints the same as one JSON object."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from flashmemory.costmodel.anchors import sized
from flashmemory.costmodel.disk import DiskKnobs
from flashmemory.costmodel.plan import MODELS, SCAN_LIMIT, UPSTREAM_SHARE, FmSettings, Plan, h20_node, pages_of, plan
from flashmemory.errors import UserError

G = 1e9
GPU_FLAGS = ("hbm_gb", "hbm_tbps", "pcie_gbps", "tflops")  # a node of H20s when these are the preset's


def _ctx(raw: str) -> int:
    """A context length: an integer, or with a K (x1024) or M (x1048576) suffix."""
    mult = {"K": 1024, "M": 1048576}.get(raw[-1:].upper(), 1)
    try:
        return int(raw[:-1] if mult > 1 else raw) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected tokens, e.g. 1048576, 256K or 1M") from None


def _frac(raw: str) -> float | None:
    if raw == "sglang":
        return None
    try:
        return float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected a fraction or 'sglang'") from None


def register(sub: Any) -> None:
    n = h20_node()
    hw, d = n.hw, DiskKnobs()
    p = sub.add_parser(
        "plan",
        help="PROJECTED node plan: requests per tier, bytes moved, disk bandwidth, tok/s, yes/no",
        description="Plan a FlashMemory decode node from the cost model (a projection, nothing measured): how many "
        "requests of --context tokens each tier holds (HBM token pool, host DRAM, disk), the bytes each "
        "tier moves per decode token, whether the disks' read-ahead keeps up with Level 1's tau window, "
        "the projected decode tok/s, and whether --concurrency requests fit; if not, which resource "
        "runs out first and by how much. Defaults: upstream's 8xH20 decode node with 4 NVMe drives.",
    )
    g = p.add_argument_group("node (defaults: 8xH20, upstream's decode launch, fitted constants)")
    g.add_argument("--gpus", type=int, default=hw.n_gpus, help="decode GPUs = tensor parallel size (default 8)")
    g.add_argument(
        "--hbm-gb",
        type=float,
        default=hw.hbm_gb,
        help=f"memory per GPU as the driver reports it, GB (default {hw.hbm_gb:.1f} = H20's 97,871 MiB)",
    )
    g.add_argument("--hbm-tbps", type=float, default=hw.hbm_tbps, help="HBM bandwidth per GPU, TB/s (default 4.0)")
    g.add_argument(
        "--pcie-gbps",
        type=float,
        default=hw.pcie_gbps,
        help="effective host-to-GPU bandwidth per GPU, GB/s (default 50)",
    )
    g.add_argument("--tflops", type=float, default=hw.tflops, help="dense BF16 TFLOP/s per GPU (default 148)")
    g.add_argument("--host-ram-gb", type=float, default=hw.host_ram_gb, help="host DRAM per node, GB (default 2265)")
    g.add_argument(
        "--host-fraction",
        type=float,
        default=hw.host_fraction,
        help=f"share of host DRAM usable for mirrors, landing windows and the page cache (default "
        f"{hw.host_fraction:g}, fitted on upstream's 1M ceiling)",
    )
    g.add_argument(
        "--mem-fraction",
        type=_frac,
        default=n.serving.mem_fraction,
        help=f"--mem-fraction-static of the decode server, or 'sglang' for sglang's default formula "
        f"(default {n.serving.mem_fraction:g}, fitted on upstream's stock 256K concurrency)",
    )
    g.add_argument(
        "--max-running",
        type=int,
        default=n.serving.max_running,
        help="--max-running-requests of the decode server (default 128, upstream's launch)",
    )
    g.add_argument(
        "--overhead-ms",
        type=float,
        default=hw.overhead_ms,
        help=f"fixed cost per decode step, ms (default {hw.overhead_ms:.2f}, fitted on upstream's stock 256K tok/s)",
    )
    k = p.add_argument_group("disks (the disk tier; --disks 0: none, host DRAM holds every mirror)")
    k.add_argument("--disks", type=int, default=d.drives, help="NVMe drives per node (default 4)")
    k.add_argument("--disk-tb", type=float, default=d.drive_tb, help="capacity per drive, TB (default 7.68)")
    k.add_argument(
        "--disk-read-gbps",
        type=float,
        default=d.read_gbps,
        help="sequential read per drive, GB/s (default 6.5, PCIe Gen4 x4 class)",
    )
    k.add_argument(
        "--disk-write-gbps", type=float, default=d.write_gbps, help="sequential write per drive, GB/s (default 3.5)"
    )
    k.add_argument(
        "--disk-efficiency",
        type=float,
        default=d.efficiency,
        help="share of the datasheet bandwidth reached with ~1-MB page reads (default 0.8)",
    )
    k.add_argument(
        "--disk-fraction",
        type=float,
        default=d.disk_fraction,
        help="share of each drive the page stores may fill (default 0.9)",
    )
    k.add_argument(
        "--disk-copies",
        choices=("rank", "node"),
        default="rank",
        help="rank: one store per GPU rank, as the PageStore does (default); node: one shared store (not built)",
    )
    w = p.add_argument_group("model and workload")
    w.add_argument(
        "--model",
        choices=MODELS,
        default=MODELS[0],
        help="model geometry (default dsv4-flash; DSv4-Pro is not in the cost model)",
    )
    w.add_argument("--context", type=_ctx, default=1048576, help="tokens per request: 1048576, 256K, 1M (default 1M)")
    w.add_argument("--concurrency", type=int, default=64, help="requests decoding at once (default 64)")
    w.add_argument(
        "--output-tokens",
        type=int,
        default=d.output_tokens,
        help="decode tokens per request: sets how often admissions write their history to disk (default 8192)",
    )
    f = p.add_argument_group("FlashMemory settings")
    kmax = f.add_mutually_exclusive_group()
    kmax.add_argument(
        "--kmax",
        type=int,
        default=None,
        help="resident pages per request (SGLANG_PATHP_PAGE_KMAX); default: from --budget-share",
    )
    kmax.add_argument(
        "--budget-share",
        type=float,
        default=UPSTREAM_SHARE,
        help="resident share of a request's pages, KMAX = ceil(share x pages) "
        "(SGLANG_PATHP_PAGE_KMAX_RATIO; default 0.09375 = upstream's 96 of 1,024 pages at 256K)",
    )
    f.add_argument(
        "--credit-c4",
        type=int,
        choices=(0, 1),
        default=1,
        help="SGLANG_PD_CREDIT_OFFLOADED_C4: 1 prices the token pool without the c4 KV, the reserve rows "
        "taken from the same budget (default 1; with 0 the pool admits what stock's does)",
    )
    f.add_argument(
        "--tau",
        type=int,
        default=64,
        help="decode steps per Level-1 cycle (SGLANG_RETRIEVER_INTERVAL; default 64): the read-ahead "
        "window is tau x step",
    )
    f.add_argument(
        "--turnover",
        type=float,
        default=1.0,
        help="share of the resident set replaced per cycle (default 1.0, the worst case; not measured)",
    )
    f.add_argument(
        "--hit-rate",
        type=float,
        default=None,
        help="host page-cache hit rate of recalled pages (default: the share of the history it holds)",
    )
    f.add_argument(
        "--path-i",
        choices=("auto", "on", "off"),
        default="auto",
        help="offload the 18 non-retriever layers' index keys too (auto: on at >= 1M tokens)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object instead of the report")
    p.set_defaults(func=run)


POSITIVE = (
    "gpus",
    "hbm_gb",
    "hbm_tbps",
    "pcie_gbps",
    "tflops",
    "host_ram_gb",
    "max_running",
    "disk_tb",
    "disk_read_gbps",
    "disk_write_gbps",
    "context",
    "concurrency",
    "output_tokens",
    "tau",
)
FRACTIONS = ("host_fraction", "disk_efficiency", "disk_fraction", "budget_share")
UNIT = ("turnover", "hit_rate")


def _check(a: argparse.Namespace) -> None:
    """One UserError naming the flag for a value out of range."""

    def bad(name: str, v: object, need: str) -> UserError:
        return UserError(f"--{name.replace('_', '-')} {v}: must be {need}")

    for name in POSITIVE:
        v = getattr(a, name)
        if not (v > 0 and math.isfinite(v)):
            raise bad(name, v, "> 0")
    for name in FRACTIONS + (("mem_fraction",) if a.mem_fraction is not None else ()):
        v = getattr(a, name)
        if not 0 < v <= 1:
            raise bad(name, v, "in (0, 1]")
    for name in UNIT:
        v = getattr(a, name)
        if v is not None and not 0 <= v <= 1:
            raise bad(name, v, "in [0, 1]")
    if a.disks < 0:
        raise bad("disks", a.disks, ">= 0 (0: no disk tier)")
    if not (a.overhead_ms >= 0 and math.isfinite(a.overhead_ms)):
        raise bad("overhead_ms", a.overhead_ms, ">= 0")
    if a.context < 4:
        raise bad("context", a.context, ">= 4 tokens")
    if a.kmax is not None and not 1 <= a.kmax <= pages_of(a.context):
        raise bad("kmax", a.kmax, f"in [1, {pages_of(a.context)}] (the pages of a {a.context}-token request)")


def build(a: argparse.Namespace) -> Plan:
    """The plan from parsed flags (after `_check`)."""
    n = h20_node()
    hw = dataclasses.replace(
        n.hw,
        n_gpus=a.gpus,
        hbm_gb=a.hbm_gb,
        hbm_tbps=a.hbm_tbps,
        pcie_gbps=a.pcie_gbps,
        tflops=a.tflops,
        host_ram_gb=a.host_ram_gb,
        host_fraction=a.host_fraction,
        overhead_ms=a.overhead_ms,
        max_running=a.max_running,
    )
    sv = dataclasses.replace(n.serving, mem_fraction=a.mem_fraction, max_running=a.max_running)
    node = dataclasses.replace(n, hw=hw, serving=sv)
    disk = (
        None
        if a.disks == 0
        else DiskKnobs(
            drives=a.disks,
            read_gbps=a.disk_read_gbps,
            write_gbps=a.disk_write_gbps,
            efficiency=a.disk_efficiency,
            drive_tb=a.disk_tb,
            disk_fraction=a.disk_fraction,
            copies=1 if a.disk_copies == "node" else None,
        )
    )
    fm = FmSettings(
        kmax=a.kmax,
        budget_share=a.budget_share,
        credit_c4=bool(a.credit_c4),
        tau=a.tau,
        turnover=a.turnover,
        hit_rate=a.hit_rate,
        path_i={"on": True, "off": False}.get(a.path_i),
    )
    try:
        return plan(node, disk, a.context, a.concurrency, fm, a.output_tokens)
    except ValueError as e:  # the node cannot hold the weights, or the like: a statement about the inputs
        raise UserError(str(e)) from None


def label(ctx: int) -> str:
    return f"{ctx // 1048576}M" if ctx % 1048576 == 0 else f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def question(a: argparse.Namespace, pl: Plan) -> str:
    """'1M x 64 on 8xH20 with NVMe': the node named as the preset only when its hardware flags are the preset's."""
    d = h20_node().hw
    h20 = all(getattr(a, k) == getattr(d, k) for k in GPU_FLAGS)
    node = f"{a.gpus}xH20" if h20 else f"{a.gpus} GPUs of {a.hbm_gb:g} GB"
    host = "" if a.host_ram_gb == d.host_ram_gb else f", {a.host_ram_gb:,.0f} GB host DRAM"
    disks = f"{pl.disk.drives} NVMe" if pl.disk else "no disks"
    return f"{label(pl.ctx)} x {pl.conc} on {node}{host} with {disks}"


def _amount(v: float, unit: str) -> str:
    if unit == "B":
        return f"{v / 1e12:,.2f} TB" if v >= 1e12 else f"{v / G:,.1f} GB" if v >= G else f"{v / 1e6:,.2f} MB"
    if unit == "ms per cycle":
        return f"{v:,.0f} ms"
    return f"{v:,.0f}"


def verdict(a: argparse.Namespace, pl: Plan) -> str:
    """The answer line, and for a plan that does not fit, every short resource from the first to run out."""
    if pl.fits:
        return f"{question(a, pl)}: YES (projected; every resource holds {pl.conc} or more)"
    short = sorted((r for r in pl.resources if r.cap < pl.conc), key=lambda r: r.cap)
    parts = [
        f"{r.name}: holds {r.cap} of {pl.conc} (needs {_amount(r.need, r.unit)}, has "
        f"{_amount(r.have, r.unit)}: {r.need / r.have:.2f}x)"
        for r in short
    ]
    return (
        f"{question(a, pl)}: NO (projected). First to run out: " + parts[0] + "".join(f"; then {x}" for x in parts[1:])
    )


def report(a: argparse.Namespace, pl: Plan) -> dict[str, Any]:
    """Everything printed, as JSON-ready values (bytes in B, bandwidth in B/s, times in ms)."""
    pt = pl.point
    rd_need = pt.read_gb_cycle * G / (pt.window_ms * 1e-3)
    wr_need = pt.write_gb_cycle * G / (pt.window_ms * 1e-3)
    return {
        "projected": True,
        "question": question(a, pl),
        "answer": pl.fits,
        "first_out": pl.first_out.name if pl.first_out else None,
        "inputs": {
            "node": dataclasses.asdict(pl.node.hw),
            "serving": dataclasses.asdict(pl.node.serving),
            "disk": dataclasses.asdict(pl.disk) if pl.disk else None,
            "model": a.model,
            "context": pl.ctx,
            "concurrency": pl.conc,
            "output_tokens": a.output_tokens,
            "flashmemory": {**dataclasses.asdict(pl.fm), "kmax_resolved": pl.kmax, "path_i_resolved": pl.path_i},
        },
        "tiers": [dataclasses.asdict(t) for t in pl.tiers],
        "resources": [{**dataclasses.asdict(r), "short": r.cap < pl.conc} for r in pl.resources],
        "disk": None
        if pl.disk is None
        else {
            "hit_rate": pl.hit_rate,
            "read_bytes_cycle": pt.read_gb_cycle * G,
            "write_bytes_cycle": pt.write_gb_cycle * G,
            "read_need_bps": rd_need,
            "read_have_bps": pl.disk.read_bps,
            "write_need_bps": wr_need,
            "write_have_bps": pl.disk.write_bps,
            "disk_ms_cycle": pt.disk_ms_cycle,
            "window_ms": pt.window_ms,
            "keeps_up": pt.window_share <= 1.0,
        },
        "throughput": {
            "step_ms": pt.step_ms,
            "tok_s": pt.tok_s,
            "step_dram_ms": pt.step_dram_ms,
            "tok_s_dram": pt.tok_s_dram,
            "admitted": pl.admitted,
            "tok_s_admitted": pl.tok_s_admitted,
        },
        "verdict": verdict(a, pl),
    }


def _per_token(v: float) -> str:
    return f"{v / 1e6:,.2f} MB" if v >= 1e6 else f"{v / 1e3:,.1f} KB"


def show(a: argparse.Namespace, pl: Plan, r: dict[str, Any]) -> None:
    """The report as text: inputs, tiers, resources, disk bandwidth, throughput, the answer."""
    hw, sv, fm, pt = pl.node.hw, pl.node.serving, pl.fm, pl.point
    frac = (
        f"{sv.mem_fraction:g}" if sv.mem_fraction is not None else f"{sized(pl.node).mem_fraction:g} (sglang's default)"
    )
    share = f"budget share {fm.budget_share:.4g} of {pages_of(pl.ctx):,} pages" if fm.kmax is None else "--kmax"
    hit = "given" if fm.hit_rate is not None else "the cache's share of the history"
    print(f"PROJECTED by the cost model (flashmemory/costmodel; nothing measured): {question(a, pl)}\n\nInputs")
    print(
        f"  node         {hw.n_gpus} GPUs x {hw.hbm_gb:.1f} GB, {hw.hbm_tbps:g} TB/s, {hw.tflops:g} TFLOP/s, H2D "
        f"{hw.pcie_gbps:g} GB/s each; --mem-fraction-static {frac}; --max-running-requests {sv.max_running}; "
        f"host DRAM {hw.host_ram_gb:,.0f} GB x {hw.host_fraction:g} usable; {hw.overhead_ms:.2f} ms fixed per step"
    )
    if pl.disk:
        dk = pl.disk
        print(
            f"  disks        {dk.drives} x {dk.drive_tb:g} TB, {dk.read_gbps:g} GB/s read / {dk.write_gbps:g} write "
            f"each x {dk.efficiency:g} efficiency, {dk.disk_fraction:g} fillable; "
            f"{dk.n_copies(hw)} store(s) ({a.disk_copies})"
        )
    else:
        print("  disks        none: host DRAM holds every rank's mirror")
    print(f"  model        {a.model}; {pl.conc} requests x {pl.ctx:,} tokens, {a.output_tokens:,} output tokens each")
    print(
        f"  FlashMemory  KMAX {pl.kmax} ({share}), CREDIT_C4={int(fm.credit_c4)}, tau {fm.tau}, turnover "
        f"{fm.turnover:g}, Path-I {'on' if pl.path_i else 'off'}, cache hit rate {pl.hit_rate:.3f} ({hit})"
    )
    print("\nTiers (bytes moved: per decode token of one request)")
    for t in pl.tiers:
        moves = ", ".join(f"{k} {_per_token(v)}" for k, v in t.moves.items())
        print(f"  {t.name:18} holds {t.fits:>7,} requests at {_amount(t.bytes_per_request, 'B')} each; {moves}")
    print(f"\nResources at {pl.conc} requests (requests each holds; need / have)")
    for x in pl.resources:
        mark = "SHORT" if x.cap < pl.conc else "ok"
        cap = f"{x.cap:,}+" if x.unit == "ms per cycle" and x.cap == SCAN_LIMIT else f"{x.cap:,} "
        print(f"  {mark:5} {x.name:50} {cap:>8}  {_amount(x.need, x.unit)} / {_amount(x.have, x.unit)}")
    if r["disk"]:
        d = r["disk"]
        print(
            f"\nDisk read-ahead: {pt.read_gb_cycle:,.1f} GB read and {pt.write_gb_cycle:,.1f} GB written per "
            f"cycle; needs {d['read_need_bps'] / G:,.1f} GB/s read (has {d['read_have_bps'] / G:,.1f}) and "
            f"{d['write_need_bps'] / G:,.1f} GB/s write (has {d['write_have_bps'] / G:,.1f}) to land in the "
            f"{pt.window_ms:,.0f} ms window: disk busy {pt.disk_ms_cycle:,.0f} ms, "
            + ("keeps up" if d["keeps_up"] else f"does NOT keep up ({pt.window_share:.2f}x the window)")
        )
    adm = (
        ""
        if pl.fits
        else (
            f"; at {pl.admitted} (the most every resource allows): {pl.tok_s_admitted:,.0f} tok/s"
            if pl.admitted >= 1
            else "; no request fits"
        )
    )
    print(
        f"\nThroughput: {pt.tok_s:,.0f} tok/s at {pl.conc} (step {pt.step_ms:.1f} ms"
        + ("" if pt.tok_s == pt.tok_s_dram else f"; {pt.tok_s_dram:,.0f} if the disk kept up")
        + ")"
        + (" if it were admitted" if not pl.fits else "")
        + adm
    )
    print(f"\n{r['verdict']}")
    print(
        "  Model: sglang 0.5.23's pool sizing, calibrated step (docs/costmodel.md), disk arm (docs/disk-tier.md). "
        "Not in it: I/O CPU time, PCIe contention, drive tails, prefill."
    )


def run(a: argparse.Namespace) -> int:
    _check(a)
    pl = build(a)
    r = report(a, pl)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        show(a, pl, r)
    return 0
