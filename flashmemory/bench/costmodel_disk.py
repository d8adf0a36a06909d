"""The disk-tier table of `flashmemory bench costmodel`: FlashMemory + NVMe at 1M context on 8xH20
against host-DRAM-only FlashMemory and HiSparse at the same concurrency, and whether >= 64 concurrent 1M-token
requests per node fit at <= 10% throughput loss. Model: `flashmemory.costmodel.disk` (an estimate)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from flashmemory.bench.table import print_table
from flashmemory.costmodel import HiSparseKnobs, PolicyKnobs, baseline_flops, hisparse_bytes, throughput_at
from flashmemory.costmodel.disk import DiskKnobs, disk_point, max_conc_within
from flashmemory.costmodel.peers import kmax_for
from flashmemory.costmodel.throughput import Hardware

CTX = 1048576
CONCS = (32, 51, 64, 80, 96)
GOAL_CONC, GOAL_LOSS = 64, 0.10


def add_disk_args(p: argparse.ArgumentParser) -> None:
    d = DiskKnobs()
    p.add_argument("--disk-drives", type=int, default=d.drives, help="disk arm: NVMe drives per node (default 4)")
    p.add_argument("--disk-read-gbps", type=float, default=d.read_gbps, help="disk arm: read GB/s per drive")
    p.add_argument("--disk-write-gbps", type=float, default=d.write_gbps, help="disk arm: write GB/s per drive")
    p.add_argument(
        "--disk-efficiency",
        type=float,
        default=d.efficiency,
        help="disk arm: share of datasheet bandwidth reached with ~1-MB page reads (default 0.8)",
    )
    p.add_argument("--disk-tb", type=float, default=d.drive_tb, help="disk arm: TB per drive")
    p.add_argument(
        "--output-tokens",
        type=int,
        default=d.output_tokens,
        help="disk arm: decode tokens per request (sets the rate of admissions written to disk)",
    )
    p.add_argument(
        "--disk-hit-rate",
        type=float,
        default=None,
        help="disk arm: host-cache hit rate of recalled pages (default: the share of the history it holds)",
    )


def disk_knobs(args: argparse.Namespace) -> DiskKnobs:
    """DiskKnobs from the flags; ValueError names the field."""
    return DiskKnobs(
        drives=args.disk_drives,
        read_gbps=args.disk_read_gbps,
        write_gbps=args.disk_write_gbps,
        efficiency=args.disk_efficiency,
        drive_tb=args.disk_tb,
        output_tokens=args.output_tokens,
        hit_rate=args.disk_hit_rate,
    )


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def disk_report(
    hw: Hardware,
    dk: DiskKnobs,
    hs: HiSparseKnobs,
    overhead_ms: float,
    turnover: float,
    pool_cap: int | None = None,
    hisparse_cap: int | None = None,
) -> dict[str, Any]:
    """`pool_cap` / `hisparse_cap`: the requests sglang's token pool admits at 1M for FlashMemory / HiSparse
    (None: the HBM bound of the bytes one request occupies)."""
    kmax = kmax_for(CTX)
    over = dataclasses.replace(hw, overhead_ms=overhead_ms)
    scenarios = {
        f"per-rank stores, turnover {turnover:g}": (dk, PolicyKnobs(path_i=True, turnover=turnover)),
        f"per-rank stores, turnover {turnover / 2:g}": (dk, PolicyKnobs(path_i=True, turnover=turnover / 2)),
        f"node-shared store, turnover {turnover:g}": (
            dataclasses.replace(dk, copies=1),
            PolicyKnobs(path_i=True, turnover=turnover),
        ),
    }
    hb, hf = hisparse_bytes(CTX, hs), baseline_flops(CTX).total
    rows, out = [], {}
    for name, (k, pk) in scenarios.items():
        pts = []
        for c in CONCS:
            p = disk_point(CTX, kmax, c, over, k, pk, pool_cap=pool_cap)
            h = (
                throughput_at(hb, hf, over, c, sync_pcie=True, extra_ms=hs.step_overhead_ms)
                if hisparse_cap is None or c <= hisparse_cap
                else None
            )
            pts.append({**dataclasses.asdict(p), "hisparse_tok_s": h[0] if h else None})
            rows.append(
                [
                    name,
                    c,
                    "yes" if p.fits else f"no ({p.bound})",
                    f"{p.hit_rate:.2f}",
                    f"{p.read_gb_cycle:.1f} / {p.write_gb_cycle:.1f}",
                    f"{p.disk_ms_cycle:.0f}",
                    f"{p.window_ms:.0f}",
                    f"{p.window_share:.0%}",
                    f"{p.tok_s:.0f}",
                    f"{p.tok_s_dram:.0f}" + ("" if p.dram_fits else "*"),
                    f"{100 * p.loss:.1f}%",
                    _fmt(h[0] if h else None),
                ]
            )
        best = max_conc_within(CTX, kmax, over, k, GOAL_LOSS, pk, pool_cap)
        best_roof = max_conc_within(CTX, kmax, hw, k, GOAL_LOSS, pk, pool_cap)
        out[name] = {
            "points": pts,
            "max_conc_within_10pct": best,
            "max_conc_within_10pct_roofline": best_roof,
            "knobs": dataclasses.asdict(k),
            "turnover": pk.turnover,
        }
    print_table(
        f"DISK TIER ESTIMATE (not measured): 1M context, KMAX {kmax}, Path-I, {hw.n_gpus}xH20, "
        f"+{overhead_ms:g} ms per step; {dk.drives} NVMe x {dk.read_gbps:g} GB/s read / {dk.write_gbps:g} write "
        f"x {dk.efficiency:g}, "
        f"{dk.drive_tb:g} TB each; host cache = {hw.host_ram_gb:g} GB x {hw.host_fraction:g}; "
        f"{dk.output_tokens} output tokens per request",
        [
            "scenario",
            "conc",
            "fits",
            "cache hit",
            "disk GB/cycle rd / wr",
            "disk ms",
            "window ms",
            "share",
            "tok/s disk",
            "tok/s DRAM-only",
            "loss",
            "HiSparse tok/s",
        ],
        rows,
    )
    lines = [
        "  *: DRAM-only does not fit: per-rank host mirrors hold "
        f"{next(iter(out.values()))['points'][0]['dram_cap']} at most; its "
        "tok/s is what it would reach with enough DRAM (the reference for the loss). HiSparse '-': its token",
        "  pool (or host DRAM, HBM) does not admit it. HiSparse + disk is not modelled: its swap-in is",
        "  per step, synchronous, in 584-B entries (7x read amplification at 4-KiB blocks, latency-bound).",
    ]
    for name, v in out.items():
        ok = v["max_conc_within_10pct"] >= GOAL_CONC
        lines.append(
            f"  {name}: >= {GOAL_CONC} concurrent 1M requests at <= 10% loss: {'YES' if ok else 'NO'} "
            f"(up to {v['max_conc_within_10pct']}; at roofline step times, no fixed cost: "
            f"{v['max_conc_within_10pct_roofline']})"
        )
    lines += [
        "  Assumes: history on disk per copy (per-rank = the PageStore built now; node-shared is not built and",
        "  would also let DRAM alone hold ~8x more); recalls uniform over the history for the cache hit rate;",
        "  reads within the tau window cost nothing, beyond it steps wait; write-behind = admissions' pages the",
        "  cache cannot hold; no I/O CPU cost, no PCIe contention, no drive tail latency. `bench tier` measures",
        "  this machine's disk -> host -> reserve path; its disk is not an NVMe array.",
    ]
    print("\n".join(lines))
    return {"ctx": CTX, "kmax": kmax, "overhead_ms": overhead_ms, "scenarios": out}
