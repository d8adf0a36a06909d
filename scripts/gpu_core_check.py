#!/usr/bin/env python3
"""The package's own device code on one GPU, without sglang: one prepared run for a lent H200 (<= 8 minutes).

    PYTHONPATH=. python scripts/gpu_core_check.py                      # CUDA, full sizes -> docs/gpu/results.*
    PYTHONPATH=. python scripts/gpu_core_check.py --device cpu --quick  # tiny sizes, correctness only (tests)

Checks (see each module in scripts/gpu_core/ for the details):
  a  offload engine on the device vs the CPU engine, bitwise, on a random churn trace (copy and shrink layouts at
     DeepSeek-V4 entry sizes); page recall bandwidth vs a raw pinned copy; a compute kernel's slowdown while
     recall runs on the side stream
  b  Level 2 (mask and score-resident) captured once in a CUDA graph, replayed >= 100 steps at batch 1/64/128
     while the resident set changes, equal to eager every step
  c  Level-1 scorer (3 layers, fp8 keys) at batch 1/64/128 and 64K/256K chunks vs a GEMM of equal FLOPs; native
     indexer x21 every step vs Level 1 / tau + score-resident Level 2 x21, up to 1M tokens
  d  miss monitor per cycle vs native indexer x21 per step
It prints one summary line per check, writes results.json and results.md (device, torch, every figure) after
each check (a later crash or timeout keeps what finished), and exits 1 if a correctness check failed. Speed
goals are reported, never enforced. It imports only the package core (scripts/gpu_core/core.py, the one place)
and needs only torch (>= 2.1 APIs) and the standard library: the H200 image has torch 2.11, no sglang.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from datetime import UTC, datetime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: the gpu_core package

import torch  # noqa: E402
from gpu_core import level2_check, offload_check, perf_check  # noqa: E402
from gpu_core.core import CheckResult, Sizes, atomic_write_text  # noqa: E402

PROG = "gpu_core_check"
# Run order: (b) last, so a failed graph capture (which can leave the CUDA context unusable) costs nothing else.
CHECKS = {"a": offload_check.run, "c": perf_check.run_scorer, "d": perf_check.run_monitor, "b": level2_check.run}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default cuda; cpu needs --quick")
    p.add_argument("--quick", action="store_true", help="tiny sizes, correctness only (CPU smoke run, < 1 minute)")
    p.add_argument(
        "--out",
        default=None,
        help="folder for results.json / results.md (default docs/gpu; with "
        "--quick nothing is written unless --out is given)",
    )
    p.add_argument("--only", default="a,b,c,d", help="comma-separated checks to run (default a,b,c,d)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="print tracebacks of checks that raise")
    return p.parse_args(argv)


def _env(device: torch.device, sz: Sizes) -> dict:
    info = dict(
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device_type=device.type,
        quick=sz.quick,
        host=platform.node(),
        cpus=os.cpu_count(),
    )
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["device_memory_GiB"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def render_md(env: dict, results: list[CheckResult], ok: bool) -> str:
    lines = [
        "# FlashMemory core on one GPU (`scripts/gpu_core_check.py`)",
        "",
        f"{env['date']}; device {env['device']}; torch {env['torch']} (CUDA {env['cuda']}); Python "
        f"{env['python']}; {'quick (tiny sizes, correctness only)' if env['quick'] else 'full sizes'}.",
        f"Correctness: **{'all passed' if ok else 'FAILED'}**.",
        "",
    ]
    for r in results:
        verdict = "PASS" if r.ok else "FAIL"
        lines += [f"## ({r.name}) {r.title}", "", f"**{verdict}** ({r.wall_s:.1f} s): {r.summary}", ""]
        lines += [f"- FAILED: {f}" for f in r.failures] + [f"- skipped: {s}" for s in r.skipped]
        for key, val in r.figures.items():
            if isinstance(val, list) and val and isinstance(val[0], dict):
                head = list(val[0])
                lines += ["", f"{key}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                lines += ["| " + " | ".join(_fmt(row.get(h)) for h in head) + " |" for row in val]
                lines.append("")
            else:
                lines.append(f"- {key}: {_fmt(val)}")
        lines.append("")
    return "\n".join(lines)


def write(out: str | None, env: dict, results: list[CheckResult], ok: bool) -> None:
    if out is None:
        return
    doc = dict(
        env,
        ok=ok,
        checks={
            r.name: dict(
                title=r.title,
                ok=r.ok,
                summary=r.summary,
                wall_s=r.wall_s,
                failures=r.failures,
                skipped=r.skipped,
                figures=r.figures,
            )
            for r in results
        },
    )
    atomic_write_text(os.path.join(out, "results.json"), json.dumps(doc, indent=1, default=str) + "\n")
    atomic_write_text(os.path.join(out, "results.md"), render_md(env, results, ok))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    bad = [c for c in only if c not in CHECKS]
    if bad or not only:
        print(f"{PROG}: --only {args.only!r}: choose from a,b,c,d", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"{PROG}: --device cuda: torch {torch.__version__} sees no CUDA device (use --device cpu --quick)",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu" and not args.quick:
        print(f"{PROG}: --device cpu needs --quick (the full sizes are GPU sizes)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    sz = Sizes.tiny() if args.quick else Sizes.full()
    default_out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "gpu")
    out = args.out if args.out is not None else (None if args.quick else default_out)
    env = _env(device, sz)
    print(
        f"{PROG}: {env['device']}, torch {env['torch']}, {'quick' if sz.quick else 'full'}; checks "
        f"{','.join(c for c in CHECKS if c in only)}",
        flush=True,
    )
    results: list[CheckResult] = []
    t_all = time.perf_counter()
    for name, fn in CHECKS.items():
        if name not in only:
            continue
        t0 = time.perf_counter()
        try:
            res = fn(sz, device, args.seed)
        except Exception as e:  # one check's crash is its failure; the others still run and the file is written
            res = CheckResult(name, f"check {name}")
            res.fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            res.summary = "raised before finishing"
            if args.debug:
                traceback.print_exc()
        res.wall_s = round(time.perf_counter() - t0, 2)
        results.append(res)
        print(f"[{name}] {'PASS' if res.ok else 'FAIL'} {res.wall_s:.1f}s: {res.summary}", flush=True)
        for f in res.failures[:5]:
            print(f"    failed: {f}", flush=True)
        for s in res.skipped:
            print(f"    skipped: {s}", flush=True)
        write(out, dict(env, wall_s=round(time.perf_counter() - t_all, 1)), results, all(r.ok for r in results))
    ok = all(r.ok for r in results)
    print(
        f"{PROG}: {'all correctness checks passed' if ok else 'a correctness check FAILED'} in "
        f"{time.perf_counter() - t_all:.1f}s" + (f"; results in {out}/" if out else ""),
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
