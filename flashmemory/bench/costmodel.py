"""`flashmemory bench costmodel`: the calibrated cost model of DeepSeek-V4-Flash decode. First the fitted constants
and every published anchor next to the model (`--anchors` stops there and after the 8xH20 projections), then the
projections (stock, HiSparse, FlashMemory, disk tier: max concurrency and tok/s at 128K, 256K, 1M), per-token
FLOPs and per-request bytes next to upstream's README tables, the side-by-side table at 1-64 requests and the disk
tier.

All numbers come from `flashmemory.costmodel` (analytic, nothing is timed). Hardware flags replace the 8xH20
preset's values in the projections only; the anchors always use the presets and the fit. `--quick` is accepted
for `bench all` and changes nothing (the model is instant). The anchor, projection and side-by-side tables are
`bench.costmodel_calibrated`, the disk-tier table `bench.costmodel_disk`; the FLOP, assumption and byte tables
`bench.costmodel_tables`; this module parses flags and runs them all in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from flashmemory.bench.costmodel_calibrated import anchors_report, peer_report, projection_report
from flashmemory.bench.costmodel_disk import add_disk_args, disk_knobs, disk_report
from flashmemory.bench.costmodel_tables import assumption_report, byte_report, flop_report
from flashmemory.costmodel import (
    FlashShape,
    HiSparseKnobs,
    PolicyKnobs,
)
from flashmemory.costmodel.admission import sized
from flashmemory.costmodel.anchors import Fitted, fit, launch_node
from flashmemory.costmodel.presets import H20_NODE, Preset
from flashmemory.costmodel.projections import auto_ratio_capacity, kmax_for
from flashmemory.errors import fail

G, M = 1e9, 1e6
DEFAULT_CTX = "262144:96,524288:192,1048576:384"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default=DEFAULT_CTX, help=f"ctx:KMAX pairs, comma separated (default {DEFAULT_CTX})")
    p.add_argument(
        "--path-i",
        choices=("auto", "on", "off"),
        default="auto",
        help="offload the 18 non-retriever layers' index keys (auto: on at >= 1M, as upstream)",
    )
    p.add_argument(
        "--turnover",
        type=float,
        default=1.0,
        help="fraction of the resident set replaced per Level-1 cycle (default 1.0 = worst case)",
    )
    p.add_argument(
        "--hisparse-miss",
        type=float,
        default=0.05,
        help="HiSparse: fraction of the per-step top-512 that misses the hot buffer, i.e. 1 - hit rate "
        "(default 0.05: IndexCache's >=95%% adjacent-step overlap; not measured on V4. Measured live "
        "on the random-weight serving-tiny model, 512 slots, after the cold first step: 0.07 at a "
        "550-entry history, 0.32 at 750)",
    )
    p.add_argument(
        "--hisparse-buffer",
        type=int,
        default=HiSparseKnobs().device_buffer_size,
        help="HiSparse device_buffer_size in c4 slots per layer (default 4096, sglang's default)",
    )
    p.add_argument(
        "--hisparse-step-ms",
        type=float,
        default=0.0,
        help="HiSparse fixed cost per decode step beyond its bytes (default 0)",
    )
    p.add_argument(
        "--hisparse-ratio",
        type=int,
        default=HiSparseKnobs().host_to_device_ratio,
        help="HiSparse host_to_device_ratio: sglang prices the device c4 pool at 1/(4 x ratio) slot per "
        "token (default 2, sglang's default)",
    )
    h = H20_NODE.hw
    p.add_argument("--hbm-gb", type=float, default=None, help=f"GPU memory, GB (preset: {h.hbm_gb:.1f} = 97,871 MiB)")
    p.add_argument("--hbm-tbps", type=float, default=None, help=f"HBM TB/s (preset: {h.hbm_tbps:g})")
    p.add_argument(
        "--pcie-gbps", type=float, default=None, help=f"effective H2D GB/s per GPU (preset: {h.pcie_gbps:g})"
    )
    p.add_argument("--tflops", type=float, default=None, help=f"dense BF16 TFLOP/s per GPU (preset: {h.tflops:g})")
    p.add_argument("--mfu", type=float, default=None, help="fraction of peak FLOPs reached (preset: 1 = roofline)")
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="--mem-fraction-static of the decode servers (default: the fitted value)",
    )
    p.add_argument("--weights-gb", type=float, default=None, help="total weight bytes (default: from the shapes)")
    p.add_argument(
        "--host-ram-gb", type=float, default=None, help=f"host DRAM per node, GB (preset: {h.host_ram_gb:g})"
    )
    p.add_argument(
        "--host-fraction",
        type=float,
        default=None,
        help="share of host DRAM usable for mirrors (default: the fitted value)",
    )
    p.add_argument(
        "--overhead-ms", type=float, default=None, help="fixed cost per decode step, ms (default: the fitted value)"
    )
    p.add_argument(
        "--anchors",
        action="store_true",
        help="print only the fitted constants, the published anchors vs the model and the 8xH20 projections",
    )
    add_disk_args(p)
    p.add_argument("--json", metavar="PATH", help="also write every number as JSON (atomic)")
    p.add_argument("--quick", action="store_true", help="accepted for `bench all`; the model is instant anyway")


def _parse_contexts(raw: str) -> list[tuple[int, int]]:
    out = []
    for part in raw.split(","):
        try:
            ctx, kmax = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--contexts entry {part!r}: expected CTX:KMAX, e.g. 262144:96") from None
        if ctx < 4 or kmax < 1:
            raise ValueError(f"--contexts entry {part!r}: need CTX >= 4 and KMAX >= 1")
        out.append((ctx, kmax))
    return out


def _atomic_json(path: str, obj: Any) -> None:
    from flashmemory.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=1, default=str))


BOUNDS = {  # flag -> (lowest, highest): far beyond any real node, so the arithmetic stays finite
    "hbm_gb": (1e-3, 1e4),
    "hbm_tbps": (1e-3, 1e4),
    "pcie_gbps": (1e-3, 1e5),
    "tflops": (1e-3, 1e7),
    "mfu": (1e-3, 1.0),
    "weights_gb": (0.0, 1e6),
    "host_ram_gb": (1e-3, 1e7),
    "host_fraction": (1e-3, 1.0),
    "overhead_ms": (0.0, 1e5),
    "mem_fraction": (1e-3, 1.0),
}


def _check_bounds(args: argparse.Namespace) -> None:
    """A ValueError naming the flag for a hardware value out of range (NaN and infinity included)."""
    for name, (lo, hi) in BOUNDS.items():
        v = getattr(args, name, None)
        if v is not None and not lo <= v <= hi:
            raise ValueError(f"--{name.replace('_', '-')} {v:g}: must lie in [{lo:g}, {hi:g}]")


def _preset(args: argparse.Namespace, f: Fitted) -> Preset:
    """The calibrated 8xH20 preset with any hardware flag given on the command line in place of its value."""
    p = launch_node(f)
    hw_kw = {
        k: getattr(args, k)
        for k in (
            "hbm_gb",
            "hbm_tbps",
            "pcie_gbps",
            "tflops",
            "mfu",
            "weights_gb",
            "host_ram_gb",
            "host_fraction",
            "overhead_ms",
        )
        if getattr(args, k) is not None
    }
    hw = dataclasses.replace(p.hw, **hw_kw)
    sv = p.serving if args.mem_fraction is None else dataclasses.replace(p.serving, mem_fraction=args.mem_fraction)
    return dataclasses.replace(p, hw=hw, serving=sv)


def run(args: argparse.Namespace) -> int:
    try:
        cases = _parse_contexts(args.contexts)
        if not 0 <= args.turnover <= 1 or not 0 <= args.hisparse_miss <= 1:
            raise ValueError("--turnover and --hisparse-miss must lie in [0, 1]")
        if args.hisparse_buffer < FlashShape().index_topk:
            raise ValueError(
                f"--hisparse-buffer {args.hisparse_buffer}: must be >= index_topk "
                f"{FlashShape().index_topk} (sglang refuses a smaller hot buffer)"
            )
        if not args.hisparse_step_ms >= 0:
            raise ValueError("--hisparse-step-ms must be >= 0")
        if args.hisparse_ratio < 1:
            raise ValueError(f"--hisparse-ratio {args.hisparse_ratio}: must be >= 1 (sglang asserts it)")
        if args.overhead_ms is not None and args.overhead_ms < 0:
            raise ValueError("--overhead-ms must be >= 0")
        _check_bounds(args)
        f = fit()
        p = _preset(args, f)
        pools = sized(p)
        if pools.full_tokens < 1:
            raise ValueError(
                f"no HBM left for KV: {p.hw.hbm_gb:g} GB (--hbm-gb) x memory fraction {pools.mem_fraction:.3f} "
                f"({'--mem-fraction' if p.serving.mem_fraction is not None else 'sglang default; --mem-fraction'}) "
                f"leaves {pools.available / 1e9:,.1f} GB after the weights (--weights-gb); raise --hbm-gb or "
                "--mem-fraction, or lower --weights-gb"
            )
        hs = HiSparseKnobs(
            device_buffer_size=args.hisparse_buffer,
            hit_rate=1.0 - args.hisparse_miss,
            step_overhead_ms=args.hisparse_step_ms,
            host_to_device_ratio=args.hisparse_ratio,
            swap_layer_us=f.swap_layer_us,
        )
        dk = disk_knobs(args)
    except ValueError as e:
        return fail("bench costmodel", e)

    def knobs_for(ctx: int) -> PolicyKnobs:
        path_i = {"on": True, "off": False}.get(args.path_i, ctx >= 1048576)
        return PolicyKnobs(path_i=path_i, turnover=args.turnover)

    report: dict[str, Any] = {"anchors": anchors_report(f), "projections": projection_report(f, p, hs, dk)}
    if not args.anchors:
        report.update(
            {
                "flops": flop_report(cases),
                "assumptions": assumption_report(cases),
                "bytes": byte_report(cases, knobs_for, hs),
                "peers": peer_report(f, hs),
                "disk": disk_report(
                    p.hw,
                    dk,
                    hs,
                    p.hw.overhead_ms,
                    args.turnover,
                    auto_ratio_capacity(p, "disk", 1048576, kmax_for(1048576), hs, dk)[1],
                    auto_ratio_capacity(p, "hisparse", 1048576, 1, hs)[1],
                ),
            }
        )
    if args.json:
        _atomic_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0
