"""`flashmemory plan`: can a decode node serve N requests of a given context with FlashMemory and a disk tier?
Prints the inputs, each tier's requests and bytes, the bytes moved per token, whether the disks keep up, the
projected tok/s and the answer (which resource runs out first and by how much). All of it is the cost model's
projection (`flashmemory.costmodel.plan`); nothing is measured. `--json` prints the same as one JSON object.
This module holds the flags, their checks and the run; the report and its printed form are
`flashmemory.costmodel.plan_show`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from flashmemory.costmodel.disk import DiskKnobs
from flashmemory.costmodel.plan import MODELS, UPSTREAM_SHARE, FmSettings, Plan, h20_node, pages_of, plan
from flashmemory.costmodel.plan_show import report, show
from flashmemory.costmodel.pools import SGLANG_SWA_RATIO
from flashmemory.errors import UserError


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


def _ratio(raw: str) -> str | float:
    if raw in ("auto", "sglang"):
        return raw
    try:
        return float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected a ratio in (0, 1], 'auto' or 'sglang'") from None


MAX_CONTEXT = 1048576  # DeepSeek-V4-Flash's context length
MAX_HBM_GB = 10_000.0  # far above any GPU; bounds the arithmetic
MAX_COUNT = 1_000_000  # GPUs, drives, requests, tokens per request beyond any node


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
        help="--mem-fraction-static of the decode server before FlashMemory's reserve is taken off it, or 'sglang' "
        "for sglang's default formula (default: sglang's, 0.895 on 8xH20)",
    )
    g.add_argument(
        "--swa-ratio",
        type=_ratio,
        default="auto",
        help="--swa-full-tokens-ratio of the decode server: auto (the smallest that holds every planned request's "
        "SWA window and one newcomer's tail + output reservation, what launch_decode.sh passes; default), "
        "sglang (its DeepSeek-V4 default 0.1) or a ratio in (0, 1]",
    )
    g.add_argument(
        "--experts",
        choices=("fp8", "fp4"),
        default=hw.experts,
        help="routed-expert precision of the checkpoint (default fp8: launch_decode.sh's ds_fp8; fp4: the FP4 release)",
    )
    g.add_argument(
        "--dp",
        type=int,
        default=1,
        help="attention data-parallel ranks (--enable-dp-attention --dp N, N dividing --gpus): each rank holds only "
        "its own requests' KV instead of every TP rank holding all of it (default 1: TP attention). A projection: "
        "FlashMemory does not serve under DP attention yet",
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
    "dp",
)
BOUNDED = {
    "gpus": MAX_COUNT,
    "max_running": MAX_COUNT,
    "concurrency": MAX_COUNT,
    "disks": MAX_COUNT,
    "hbm_gb": MAX_HBM_GB,
}
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
    if a.context > MAX_CONTEXT:
        raise bad("context", a.context, f"<= {MAX_CONTEXT:,} (DeepSeek-V4-Flash's context length)")
    for name, hi in BOUNDED.items():
        if getattr(a, name) > hi:
            raise bad(name, getattr(a, name), f"<= {hi:,g}")
    for name in ("host_ram_gb", "disk_tb", "disk_read_gbps", "disk_write_gbps", "hbm_tbps", "pcie_gbps", "tflops"):
        if getattr(a, name) > 1e9:
            raise bad(name, getattr(a, name), "<= 1e9")
    if a.gpus % a.dp:
        raise bad("dp", a.dp, f"a divisor of --gpus {a.gpus} (attention DP ranks split the GPUs evenly)")
    if 64 % a.gpus:
        raise bad("gpus", a.gpus, "a divisor of 64 (DeepSeek-V4-Flash's 64 attention heads split evenly over TP)")
    if a.max_running < a.dp:
        raise bad("max_running", a.max_running, f">= --dp {a.dp} (one request per DP rank at least)")
    if not isinstance(a.swa_ratio, str) and not 0 < a.swa_ratio <= 1:
        raise bad("swa_ratio", a.swa_ratio, "in (0, 1], 'auto' or 'sglang'")
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
        experts=a.experts,
    )
    sv = dataclasses.replace(n.serving, mem_fraction=a.mem_fraction, max_running=a.max_running, dp=a.dp)
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
        ratio = SGLANG_SWA_RATIO if a.swa_ratio == "sglang" else a.swa_ratio
        return plan(node, disk, a.context, a.concurrency, fm, a.output_tokens, ratio)
    except ValueError as e:  # the node cannot hold the weights, or the like: a statement about the inputs
        raise UserError(str(e)) from None


def run(a: argparse.Namespace) -> int:
    _check(a)
    pl = build(a)
    r = report(a, pl)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        show(a, pl, r)
    return 0
