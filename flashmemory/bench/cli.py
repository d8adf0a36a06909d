"""`flashmemory bench NAME`: each benchmark module exposes `add_args(parser)` and `run(args) -> int`.

Every benchmark fails in one form, naming itself: a bad flag is argparse's line from the benchmark's own parser
(`flashmemory bench NAME: error: argument --flag: ...`), and a `UserError` or `OSError` its `run` raises is
`flashmemory bench NAME: error: <message>` (exit 2; `--debug` shows the traceback), also under `bench all`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from collections.abc import Callable

from flashmemory.bench.guard import guard_numbers
from flashmemory.errors import UserError, fail

BENCHES = {
    "scorer": ("flashmemory.bench.scorer", "Level-1 scoring throughput vs the matmul ceiling and the native indexer"),
    "labels": ("flashmemory.bench.labels", "golden-label construction vs a per-layer, per-token Python loop"),
    "recall": ("flashmemory.bench.recall", "page recall, batched gather and Level-2 modes vs raw copies / full top-k"),
    "train": ("flashmemory.bench.train", "training samples/s and peak memory vs the forward-only cost"),
    "step": ("flashmemory.bench.step", "host time and blocking ops per decode step, per mode vs the adapter off"),
    "monitor": (
        "flashmemory.bench.monitor_cost",
        "miss monitor (1 native layer per tau steps) vs the native indexer on 21 layers every step",
    ),
    "costmodel": ("flashmemory.bench.costmodel", "per-token FLOPs, bytes and a throughput estimate vs upstream tables"),
    "tier": (
        "flashmemory.bench.tier",
        "disk tier: recall disk -> host cache -> reserve vs host -> reserve, share of "
        "the tau window at increasing concurrency",
    ),
    "tier-scale": (
        "flashmemory.bench.tier_scale",
        "disk tier with many requests whose pages exceed the host page "
        "cache: read-ahead hit rate, recalls and cycles that waited for "
        "disk",
    ),
    "serve": ("flashmemory.bench.serve", "live sglang on CPU: decode tok/s, FlashMemory at ~10% residency vs stock"),
    "peers": (
        "flashmemory.bench.peers",
        "live sglang on CPU: stock, HiSparse and HiSparse+prefetch (two hot-buffer sizes), FlashMemory and "
        "FlashMemory+monitor on the same requests, counted costs per decode token side by side",
    ),
}


def available() -> dict[str, tuple[str, str]]:
    return {k: v for k, v in BENCHES.items() if importlib.util.find_spec(v[0]) is not None}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark (ratios measured side by side in one run)",
        description="Benchmarks. Every number is a ratio against a baseline measured in the same run.",
    )
    bsub = p.add_subparsers(dest="bench", metavar="NAME")
    for name, (mod, help_) in available().items():
        # argparse %-formats help strings: a literal % must be doubled or the help prints the action's dict
        bp = bsub.add_parser(name, help=help_.replace("%", "%%"), description=help_)
        m = importlib.import_module(mod)
        m.add_args(bp)
        guard_numbers(bp)  # every int / float flag: a whole / finite number in range, or argparse's one line
        bp.set_defaults(func=named(name, m.run))
    ap = bsub.add_parser("all", help="run every benchmark in turn")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.set_defaults(func=_run_all)


def named(name: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run`, with an expected failure (UserError, OSError) reported as `flashmemory bench NAME: error: ...`."""

    def run_named(args: argparse.Namespace) -> int:
        try:
            return int(run(args) or 0)
        except (UserError, OSError) as e:
            return fail(f"bench {name}", e)  # re-raises under --debug

    return run_named


def _run_all(args: argparse.Namespace) -> int:
    rc = 0
    for name, (mod, _) in available().items():
        print(f"\n=== bench {name} ===")
        m = importlib.import_module(mod)
        p = argparse.ArgumentParser()
        m.add_args(p)
        guard_numbers(p)
        rc |= named(name, m.run)(p.parse_args(["--quick"] if args.quick else []))
    return rc
