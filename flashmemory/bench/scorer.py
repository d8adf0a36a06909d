"""`flashmemory bench scorer`: Level-1 scoring cost, against two baselines timed in the same run.

(1) One Level-1 scoring (3 full-size retriever layers: query encoder + relu_head_scores over N
    dequantized keys) against a plain fp32 matmul of the same FLOPs on this machine (the ceiling).
(2) Level 1 amortized over tau decode steps against the native lightning indexer (64 heads x 128,
    sum_h relu(q_h . k) w_h over the same N keys) run for all 21 c4 layers at every step. The native
    indexer is timed for one layer and multiplied by 21. Both use the same fp32 scorer, so the ratio
    compares work, not kernels (upstream's indexer is an fp8 DeepGEMM kernel on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from flashmemory.errors import UserError
from flashmemory.retriever.fp8 import dequantize_chunks, quantize_chunks
from flashmemory.retriever.model import JointRetriever, RetrieverDims, relu_head_scores

LAYERS = (10, 12, 20)
N_C4_LAYERS = 21
NATIVE_HEADS = 64
FULL_SIZES = (65536, 262144)
QUICK_SIZES = (4096, 16384)
_MM_K = 1024  # ceiling matmul: [m, 1024] @ [1024, 1024], m chosen for equal FLOPs


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"N = {', '.join(map(str, QUICK_SIZES))} chunks (smoke run)")
    p.add_argument(
        "--sizes", default=None, help=f"comma-separated chunk counts (default {','.join(map(str, FULL_SIZES))})"
    )
    p.add_argument("--tau", type=int, default=64, help="decode steps per Level-1 cycle (default 64)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repeats per number; the median is reported (default 5, 3 with --quick)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs this process may use)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")


def level1_flops(dims: RetrieverDims, n: int, n_layers: int = len(LAYERS), batch: int = 1) -> float:
    """Multiply-adds x2 of one Level-1 scoring: per layer the query encoder (wq_a, wq_b, weights_proj)
    plus N x H x (2D for q.k, 2 for relu-weight-sum). RMSNorm, RoPE and Hadamard are O(rank + H D log D)."""
    d = dims
    query = 2 * (d.hidden * d.rank + d.rank * d.n_heads * d.head_dim + d.hidden * d.n_heads)
    score = n * d.n_heads * (2 * d.head_dim + 2)
    return float(n_layers * batch * (query + score))


def native_flops(n: int, heads: int = NATIVE_HEADS, head_dim: int = 128) -> float:
    return float(n * heads * (2 * head_dim + 2))


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(fn: Callable[[], object], repeats: int) -> float:
        fn()  # warm-up: allocator, thread pool, kernels
        sync()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    return measure


def _keys(n: int, d: int, seed: int, device: torch.device) -> torch.Tensor:
    """Dequantized fp8 index keys [N, D] fp32, built in blocks to bound the temporary memory."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, d, dtype=torch.float32, device=device)
    for s in range(0, n, 65536):
        m = min(65536, n - s)
        out[s : s + m] = dequantize_chunks(quantize_chunks(torch.randn(m, d, generator=g))).to(device)
    return out


def bench_size(model: JointRetriever, n: int, tau: int, repeats: int, device: torch.device) -> dict[str, float]:
    dims = model.dims
    measure = _timer(device)
    g = torch.Generator().manual_seed(n)
    x = {lid: torch.randn(1, dims.hidden, generator=g).to(device) for lid in model.layers}
    pos = torch.tensor([4 * n], device=device)  # the decode token sits after N c4 chunks (4 tokens each)
    keys = {lid: _keys(n, dims.head_dim, seed=lid, device=device) for lid in model.layers}

    def level1() -> None:
        for lid in model.layers:
            q, w = model.layer(lid).query(x[lid], pos)
            relu_head_scores(q, w, keys[lid])

    qn = torch.randn(1, NATIVE_HEADS, dims.head_dim, generator=g).to(device)
    wn = torch.randn(1, NATIVE_HEADS, generator=g).to(device)
    k0 = keys[model.layers[0]]
    flops = level1_flops(dims, n, len(model.layers))
    m = max(1, round(flops / (2 * _MM_K * _MM_K)))
    a = torch.randn(m, _MM_K, generator=g).to(device)
    b = torch.randn(_MM_K, _MM_K, generator=g).to(device)
    mm_flops = 2.0 * m * _MM_K * _MM_K

    with torch.no_grad():
        t_l1 = measure(level1, repeats)
        t_mm = measure(lambda: a @ b, repeats)
        t_nat = measure(lambda: relu_head_scores(qn, wn, k0), repeats)
    l1_gflops = flops / t_l1 / 1e9
    mm_gflops = mm_flops / t_mm / 1e9
    per_step_l1 = t_l1 / tau
    per_step_native = N_C4_LAYERS * t_nat
    return {
        "n_chunks": n,
        "level1_s": t_l1,
        "level1_chunks_per_s": n / t_l1,
        "level1_gflops": l1_gflops,
        "matmul_s": t_mm,
        "matmul_gflops": mm_gflops,
        "level1_vs_ceiling": l1_gflops / mm_gflops,
        "native_1layer_s": t_nat,
        "native_21layers_s": per_step_native,
        "native_gflops": native_flops(n) / t_nat / 1e9,
        "level1_per_step_s": per_step_l1,
        "level1_per_step_vs_native": per_step_l1 / per_step_native,
    }


def _table(rows: list[dict[str, float]], tau: int) -> str:
    head = (
        "N chunks",
        "L1 3-layer ms",
        "L1 chunks/s",
        "L1 GFLOP/s",
        "matmul GFLOP/s",
        "L1 / ceiling",
        "native 1 layer ms",
        "native x21 ms",
        f"L1/{tau} ms",
        f"(L1/{tau}) / (native x21)",
    )
    lines = [" | ".join(head), " | ".join("-" * len(h) for h in head)]
    for r in rows:
        cells = (
            f"{r['n_chunks']:,}",
            f"{r['level1_s'] * 1e3:.2f}",
            f"{r['level1_chunks_per_s']:.3g}",
            f"{r['level1_gflops']:.1f}",
            f"{r['matmul_gflops']:.1f}",
            f"{r['level1_vs_ceiling']:.2f}",
            f"{r['native_1layer_s'] * 1e3:.3f}",
            f"{r['native_21layers_s'] * 1e3:.2f}",
            f"{r['level1_per_step_s'] * 1e3:.3f}",
            f"{r['level1_per_step_vs_native']:.3f}",
        )
        lines.append(" | ".join(c.rjust(len(h)) for c, h in zip(cells, head)))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.sizes:
        try:
            sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
        except ValueError:
            raise UserError(f"--sizes {args.sizes!r}: expected comma-separated chunk counts") from None
    else:
        sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if not sizes or min(sizes) < 1 or args.tau < 1:
        raise UserError(f"--tau {args.tau} / --sizes {args.sizes!r}: must be >= 1")
    repeats = args.repeats or (3 if args.quick else 5)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(max(1, threads or 1))
    dims = RetrieverDims()  # full size: hidden 4096, rank 2048, 128 heads x 128, rope 64
    torch.manual_seed(0)
    with torch.device(device):
        model = JointRetriever(LAYERS, dims).eval()
    rows = [
        bench_size(model, n, args.tau, repeats, device)
        for n in tqdm(sizes, desc="bench scorer", unit="size", leave=False)
    ]
    print(
        f"Level-1 scorer, full size (hidden {dims.hidden}, rank {dims.rank}, {dims.n_heads} heads x {dims.head_dim}),"
        f" batch 1, layers {','.join(map(str, LAYERS))}; device {device}, {torch.get_num_threads()} threads, fp32;"
        f" median of {repeats} after a warm-up"
    )
    print(_table(rows, args.tau))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if device.type == "cpu" and torch.get_num_threads() > 1 and load > 1.5 * torch.get_num_threads():
        print(
            f"warning: load average {load:.1f} on {torch.get_num_threads()} threads; other processes share these "
            "CPUs, so each parallel op may stall on its slowest thread. Compare with --threads 1."
        )
    print(
        f"L1 / ceiling: Level-1 GFLOP/s over a plain fp32 matmul ([m,{_MM_K}]@[{_MM_K},{_MM_K}], same FLOPs) "
        "timed in this run. L1 chunks/s: history chunks scored per second by all 3 layers."
    )
    print(
        f"Native indexer ({NATIVE_HEADS} heads x {dims.head_dim}) is timed for ONE c4 layer and multiplied by "
        f"{N_C4_LAYERS} (all c4 layers, every decode step); Level 1 runs once every tau={args.tau} steps. "
        "Both use the same fp32 relu_head_scores on dequantized keys."
    )
    if args.json:
        from flashmemory.atomic import atomic_write_text

        atomic_write_text(
            args.json,
            json.dumps(
                {
                    "device": str(device),
                    "threads": torch.get_num_threads(),
                    "tau": args.tau,
                    "repeats": repeats,
                    "rows": rows,
                },
                indent=2,
            ),
        )
    return 0
