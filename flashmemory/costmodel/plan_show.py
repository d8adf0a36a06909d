"""What `flashmemory plan` reports about one `Plan`: `report` turns it into one JSON-ready dict (inputs, tiers,
resources with which run short, the per-token bytes and whether the disks keep up) and `show` prints the same as
tables and a one-line verdict naming the resource that runs out first. Pure formatting over the cost model's
projection; the flags and their checks are `flashmemory.costmodel.plan_cli`."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from flashmemory.costmodel.plan import SCAN_LIMIT, Plan, h20_node, pages_of
from flashmemory.costmodel.projections import auto_ratio_capacity

G = 1e9
GPU_FLAGS = ("hbm_gb", "hbm_tbps", "pcie_gbps", "tflops")  # a node of H20s when these are the preset's


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
    if unit == "tokens":
        return f"{v:,.0f} tokens"
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
            "pools": dataclasses.asdict(pl.pools),
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
        "peers": {
            arm: dict(zip(("swa_ratio", "admitted", "bound"), auto_ratio_capacity(pl.node, arm, pl.ctx)))
            for arm in ("stock", "hisparse")
        },
    }


def _per_token(v: float) -> str:
    return f"{v / 1e6:,.2f} MB" if v >= 1e6 else f"{v / 1e3:,.1f} KB"


def show(a: argparse.Namespace, pl: Plan, r: dict[str, Any]) -> None:
    """The report as text: inputs, tiers, resources, disk bandwidth, throughput, the answer."""
    hw, sv, fm, pt = pl.node.hw, pl.node.serving, pl.fm, pl.point
    frac = (
        f"{pl.pools.mem_fraction:.3f}"
        + (" (sglang's default" if sv.mem_fraction is None else " (given")
        + (", lowered by the reserve)" if fm.credit_c4 else ")")
    )
    share = f"budget share {fm.budget_share:.4g} of {pages_of(pl.ctx):,} pages" if fm.kmax is None else "--kmax"
    hit = "given" if fm.hit_rate is not None else "the cache's share of the history"
    print(f"PROJECTED by the cost model (flashmemory/costmodel; nothing measured): {question(a, pl)}\n\nInputs")
    print(
        f"  node         {hw.n_gpus} GPUs x {hw.hbm_gb:.1f} GB, {hw.hbm_tbps:g} TB/s, {hw.tflops:g} TFLOP/s, H2D "
        f"{hw.pcie_gbps:g} GB/s each; {hw.experts.upper()} experts; --mem-fraction-static {frac}; "
        f"--max-running-requests {sv.max_running}; "
        + (f"attention DP {sv.dp}; " if sv.dp > 1 else "")
        + f"host DRAM {hw.host_ram_gb:,.0f} GB x {hw.host_fraction:g} usable; {hw.overhead_ms:.2f} ms fixed per step"
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
    others = r["peers"]
    print(
        f"\nStock and HiSparse on this node (same flags, each at its smallest SWA ratio): stock admits "
        f"{others['stock']['admitted']} ({others['stock']['bound']}), HiSparse {others['hisparse']['admitted']} "
        f"({others['hisparse']['bound']}) requests of {label(pl.ctx)}"
        + (
            f"; attention DP {sv.dp}: each rank holds only its own requests' KV (FlashMemory under DP attention "
            "is run on CPU only: a projection; tok/s is TP attention's step)"
            if sv.dp > 1
            else ""
        )
    )
    print(f"\n{r['verdict']}")
    print(
        "  Model: sglang 0.5.23's pool sizing, calibrated step (docs/costmodel.md), disk arm (docs/disk-tier.md). "
        "Not in it: I/O CPU time, PCIe contention, drive tails, prefill."
    )
