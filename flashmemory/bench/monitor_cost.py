"""`flashmemory bench monitor`: the miss monitor's cost against the native indexer, timed side by side in one run.

Per request, the monitor runs once per Level-1 cycle: ONE target c4 layer's native indexer (64 heads x 128,
sum_h relu(q_h . k) w_h) over the full history of N chunks, its top-512, softmax and the miss mass against the
resident mask (`residency.monitor.miss_mass`), plus the per-page grouping (`miss_report`). The baseline is what
stock DeepSeek-V4 decode runs: the native indexer on all 21 c4 layers at EVERY step (one layer timed, x21).
Reported: monitor per cycle, native x21 per step, and the ratio (monitor / tau) / (native x21), i.e. the
monitor's share of the work the native indexer does over the same tau steps. Same fp32 scorer for both (the
ratio compares work; on GPU both are the fp8 indexer kernel).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from flashmemory.bench.scorer import N_C4_LAYERS, NATIVE_HEADS, _keys, _timer
from flashmemory.errors import UserError
from flashmemory.residency.monitor import miss_mass, miss_report
from flashmemory.retriever.model import relu_head_scores

FULL_SIZES = (65536, 262144)
QUICK_SIZES = (4096, 16384)
HEAD_DIM = 128
TOPK = 512


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"N = {', '.join(map(str, QUICK_SIZES))} chunks (smoke run)")
    p.add_argument(
        "--sizes", default=None, help=f"comma-separated chunk counts (default {','.join(map(str, FULL_SIZES))})"
    )
    p.add_argument("--tau", type=int, default=64, help="decode steps per Level-1 cycle (default 64)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed repeats, median reported (default 5, 3 with --quick)"
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs this process may use)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")


def bench_size(n: int, tau: int, repeats: int, device: torch.device) -> dict[str, float]:
    measure = _timer(device)
    g = torch.Generator().manual_seed(n)
    keys = _keys(n, HEAD_DIM, seed=7, device=device)
    q = torch.randn(1, NATIVE_HEADS, HEAD_DIM, generator=g).to(device)
    w = torch.randn(1, NATIVE_HEADS, generator=g).to(device)
    resident = (torch.rand(1, n, generator=g) < 0.1).to(device)

    def monitor() -> None:
        logits = relu_head_scores(q, w, keys)
        miss_mass(logits, resident, TOPK)
        miss_report(logits[0], resident[0], TOPK, 64, layer=0)

    with torch.no_grad():
        t_mon = measure(monitor, repeats)
        t_nat = measure(lambda: relu_head_scores(q, w, keys), repeats)
    per_step_native = N_C4_LAYERS * t_nat
    return {
        "n_chunks": n,
        "monitor_cycle_s": t_mon,
        "native_1layer_s": t_nat,
        "native_21layers_step_s": per_step_native,
        "monitor_per_step_s": t_mon / tau,
        "monitor_vs_native": (t_mon / tau) / per_step_native,
    }


def run(args: argparse.Namespace) -> int:
    try:
        sizes = (
            tuple(int(s) for s in args.sizes.split(",") if s.strip())
            if args.sizes
            else QUICK_SIZES
            if args.quick
            else FULL_SIZES
        )
    except ValueError:
        raise UserError(f"--sizes {args.sizes!r}: expected comma-separated chunk counts") from None
    if not sizes or args.tau < 1 or any(s < 1 for s in sizes):
        raise UserError(f"--tau {args.tau} / --sizes {args.sizes!r}: must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeats = args.repeats or (3 if args.quick else 5)
    rows = [bench_size(n, args.tau, repeats, device) for n in sizes]
    head = (
        "N chunks",
        "monitor/cycle ms",
        "native 1 layer ms",
        "native x21/step ms",
        f"monitor/{args.tau} ms",
        f"(monitor/{args.tau}) / (native x21)",
    )
    print(" | ".join(head))
    print(" | ".join("-" * len(h) for h in head))
    for r in rows:
        cells = (
            f"{r['n_chunks']:,}",
            f"{r['monitor_cycle_s'] * 1e3:.2f}",
            f"{r['native_1layer_s'] * 1e3:.2f}",
            f"{r['native_21layers_step_s'] * 1e3:.2f}",
            f"{r['monitor_per_step_s'] * 1e3:.3f}",
            f"{r['monitor_vs_native']:.4f}",
        )
        print(" | ".join(c.rjust(len(h)) for c, h in zip(cells, head)))
    print(
        f"device {device}; the monitor scores one native layer once per tau={args.tau} steps; the baseline scores "
        f"21 layers every step (ideal ratio 1/(21 x tau) = {1 / (N_C4_LAYERS * args.tau):.5f} plus top-k and "
        "per-page grouping overhead)."
    )
    if args.json:
        from flashmemory.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps({"tau": args.tau, "device": str(device), "rows": rows}, indent=1))
    return 0
