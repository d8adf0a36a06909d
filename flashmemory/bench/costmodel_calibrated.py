"""The calibrated-model tables of `flashmemory bench costmodel`: the fitted constants and every published anchor
next to the model, the 8xH20 projections (max concurrency and tok/s for stock, HiSparse, FlashMemory, disk tier)
and the stock / HiSparse / FlashMemory side-by-side table. Each report prints its table and returns the same
numbers as JSON-ready dicts; all values come from `flashmemory.costmodel.anchors` (analytic, nothing is timed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashmemory.bench.table import print_table
from flashmemory.costmodel import HiSparseKnobs, PolicyKnobs
from flashmemory.costmodel.anchors import TOLERANCE, Fitted, anchors, glm_anchors
from flashmemory.costmodel.disk import disk_point
from flashmemory.costmodel.peers import peer_table
from flashmemory.costmodel.presets import B200_COLO, H20_LAUNCH, H20_NODE, RTX6000_NODE, Preset
from flashmemory.costmodel.projections import projections

G = 1e9


def ctx_label(ctx: int) -> str:
    """A context length as the tables print it: 1048576 -> '1M', 262144 -> '256K'."""
    return f"{ctx // 1048576}M" if ctx % 1048576 == 0 else f"{ctx // 1024}K"


def _tok(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def anchors_report(f: Fitted) -> dict[str, Any]:
    """Fitted constants with their sources, then every published anchor next to the model (fit or held out)."""
    print_table(
        "FITTED CONSTANTS (each fitted on one published figure, never refitted)",
        ["constant", "value", "fitted on"],
        [list(r) for r in f.rows()],
    )
    print(
        "  Presets (decode side only): "
        + "; ".join(f"{p.name}: {p.source}" for p in (H20_NODE, H20_LAUNCH, B200_COLO, RTX6000_NODE))
    )
    dsv4, glm = anchors(f), glm_anchors(f)
    out = []

    def table(title: str, items: list) -> None:
        rows = []
        for a in items:
            ok = a.use in ("fit", "apart") or abs(a.ratio - 1) <= TOLERANCE
            rows.append(
                [
                    a.name,
                    a.setting,
                    f"{a.published:g}",
                    f"{a.model:.2f}",
                    f"{a.ratio:.2f}",
                    a.use,
                    "yes" if ok else "NO",
                ]
            )
            out.append({**dataclasses.asdict(a), "ratio": a.ratio, "within": ok})
        print_table(title, ["anchor", "setting", "published", "model", "model/pub", "use", "within"], rows)

    table(f"ANCHORS (DeepSeek-V4): published figure vs the calibrated model (held out within +-{TOLERANCE:.0%}?)", dsv4)
    for a in dsv4:
        if a.use != "fit" and abs(a.ratio - 1) > TOLERANCE:
            print(f"  NO: {a.name} ({a.setting}): {a.lacks or 'no reason recorded'}")
    table("APART, NOT DeepSeek-V4 (GLM; priced with DeepSeek-V4-Flash's geometry as a stand-in, never fitted)", glm)
    print("  Sources:")
    for src in dict.fromkeys(a.source for a in dsv4 + glm):
        print(f"  - {src}")
    return {"fitted": dataclasses.asdict(f), "tolerance": TOLERANCE, "anchors": out}


def projection_report(f: Fitted, p: Preset, hs: HiSparseKnobs, dk: Any) -> list[dict[str, Any]]:
    """Max concurrency and tok/s there for stock, HiSparse, FlashMemory and the disk tier on `p` (8xH20)."""

    def disk_tok_s(pr: Preset, ctx: int, kmax: int, n: int) -> float:
        return disk_point(ctx, kmax, n, pr.hw, dk, PolicyKnobs(path_i=ctx >= 1048576)).tok_s

    rows = projections(f, hs, p, disk_tok_s)
    base = {r["ctx"]: r for r in rows if r["arm"] == "stock"}
    print_table(
        f"PROJECTED (calibrated model, not measured): {p.name}, max concurrency and decode tok/s there",
        ["ctx", "arm", "KMAX", "SWA ratio", "max conc", "bound", "tok/s", "vs stock", "at ratio 0.1"],
        [
            [
                ctx_label(r["ctx"]),
                r["arm"],
                r["kmax"] if r["arm"] not in ("stock", "hisparse") else "-",
                f"{r['swa_ratio']:g}",
                r["conc"],
                r["bound"],
                f"{r['tok_s']:.0f}",
                f"{r['tok_s'] / base[r['ctx']]['tok_s']:.2f}x",
                r["conc_sglang"],
            ]
            for r in rows
        ],
    )
    print(
        f"  HiSparse: host_to_device_ratio {hs.host_to_device_ratio}, device_buffer_size {hs.device_buffer_size}, "
        f"hit rate {hs.hit_rate:g}, swap-in {hs.swap_layer_us:.0f} us per c4 layer per step. FlashMemory: KMAX "
        f"scaled from 96 at 256K, Path-I at 1M, launched with CREDIT_C4=1 (token pool without c4 KV, "
        f"--mem-fraction-static lowered by the reserve sized for TGT_CONC = the concurrency); "
        f"flashmemory-nocredit: the launch default CREDIT_C4=0, whose token pool admits "
        f"what stock's does. Disk: FlashMemory with the history on {dk.drives} NVMe per node instead of host DRAM; "
        f"tok/s includes waits for disk reads. Each arm launched with the smallest --swa-full-tokens-ratio for what it "
        f"admits (launch_decode.sh's SWA_RATIO=auto); 'at ratio 0.1': the concurrency at sglang's DeepSeek-V4 default."
    )
    return rows


def peer_report(f: Fitted, hs: HiSparseKnobs) -> dict[str, Any]:
    """Stock / HiSparse / FlashMemory on calibrated 8xH20 at 128K, 256K, 1M x 1, 16, 64 requests (projection)."""
    cells = peer_table(f, hs)
    rows = []
    for c in cells:
        parts = c.device_parts
        c4 = parts.get("c4 kv", parts.get("c4 hot buffer", 0.0))
        rows.append(
            [
                ctx_label(c.ctx),
                c.policy + (f" KMAX {c.kmax}" if c.policy == "flashmemory" else ""),
                c.device_bytes / G,
                c4 / G,
                parts["index keys"] / G,
                f"{c.max_conc} ({c.bound})",
            ]
            + [f"{_tok(c.tok_s_roof[b])} / {_tok(c.tok_s[b])}" for b in sorted(c.tok_s)]
        )
    print_table(
        f"PROJECTED stock vs HiSparse vs FlashMemory, 8xH20 (not measured): device GB one request occupies, "
        f"admitted ceiling, tok/s roofline / +{f.overhead_ms:.1f} ms per step ('-': not admitted)",
        ["ctx", "arm", "device GB", "c4 GB", "index-K GB", "max conc"]
        + [f"{b} req tok/s" for b in sorted(cells[0].tok_s)],
        rows,
    )
    print(
        "  The ceiling is sglang's token pool (a request reserves its whole context in logical tokens, priced by\n"
        "  pools.bytes_per_full_token), not the bytes a request occupies. Quality differs: HiSparse is exact,\n"
        "  FlashMemory is lossy."
    )
    return {"cells": [dataclasses.asdict(c) for c in cells]}
