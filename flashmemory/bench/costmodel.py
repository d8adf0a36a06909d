"""`flashmemory bench costmodel`: per-token FLOPs, per-request bytes and a throughput ESTIMATE for
DeepSeek-V4-Flash decode, baseline vs FlashMemory (vs a HiSparse-like LRU), next to upstream's README tables.

All numbers come from `flashmemory.costmodel` (analytic, nothing is timed); ratios are FlashMemory / baseline
computed in the same run. `--quick` is accepted for `bench all` and changes nothing (the model is instant).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from flashmemory.costmodel import (UPSTREAM, UPSTREAM_CONSTANT_GFLOP, CountRules, FlashShape, Hardware, PolicyKnobs,
                                   RetrieverShape, all_miss_bytes, attention_core_terms, baseline_bytes,
                                   baseline_flops, estimate, fit_line, flashmemory_bytes, flashmemory_flops,
                                   hisparse_bytes, kv_budget_per_gpu, n_chunks, weight_bytes)

G, M = 1e9, 1e6
DEFAULT_CTX = "262144:96,524288:192,1048576:384"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default=DEFAULT_CTX, help=f"ctx:KMAX pairs, comma separated (default {DEFAULT_CTX})")
    p.add_argument("--path-i", choices=("auto", "on", "off"), default="auto",
                   help="offload the 18 non-retriever layers' index keys (auto: on at >= 1M, as upstream)")
    p.add_argument("--turnover", type=float, default=1.0,
                   help="fraction of the resident set replaced per Level-1 cycle (default 1.0 = worst case)")
    p.add_argument("--hisparse-miss", type=float, default=0.05,
                   help="per-step miss fraction of the top-512 for the LRU policy (default 0.05)")
    hw = Hardware()
    p.add_argument("--hbm-gb", type=float, default=hw.hbm_gb, help="HBM per GPU (H20: 96)")
    p.add_argument("--hbm-tbps", type=float, default=hw.hbm_tbps)
    p.add_argument("--pcie-gbps", type=float, default=hw.pcie_gbps, help="effective H2D GB/s per GPU")
    p.add_argument("--tflops", type=float, default=hw.tflops, help="dense BF16 TFLOP/s per GPU")
    p.add_argument("--mfu", type=float, default=hw.mfu, help="fraction of peak FLOPs reached (1 = roofline)")
    p.add_argument("--mem-fraction", type=float, default=hw.mem_fraction, help="static HBM fraction for weights+KV")
    p.add_argument("--weights-gb", type=float, default=None, help="total weight bytes (default: from the shapes)")
    p.add_argument("--host-ram-gb", type=float, default=hw.host_ram_gb)
    p.add_argument("--host-fraction", type=float, default=hw.host_fraction)
    p.add_argument("--overhead-ms", type=float, default=20.0,
                   help="fixed per-step cost added in the second throughput estimate (default 20)")
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


def _label(ctx: int) -> str:
    return f"{ctx // 1048576}M" if ctx % 1048576 == 0 else f"{ctx // 1024}K"


def _table(title: str, head: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(c) for c in head]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.1f}%"


def flop_report(cases: list[tuple[int, int]], rules: CountRules = CountRules()) -> dict[str, Any]:
    s, r = FlashShape(), RetrieverShape()
    b0 = baseline_flops(cases[0][0], s, r, rules)
    const_rows = [[t.name, t.note, t.count, t.flops(rules) / G] for t in b0.terms if t.name != "indexer scoring"]
    _table(f"Constant part per decode token ({rules.flops_per_mac} FLOP/MAC): ours {b0.constant / G:.2f} GFLOP vs "
           f"upstream {UPSTREAM_CONSTANT_GFLOP} ({_pct(b0.constant / G, UPSTREAM_CONSTANT_GFLOP)})",
           ["term", "shape", "x layers", "GFLOP"], const_rows)
    rows, out = [], []
    for ctx, kmax in cases:
        b, f = baseline_flops(ctx, s, r, rules), flashmemory_flops(ctx, kmax, s, r, rules)
        up = UPSTREAM.get(ctx)
        up_ok = up is not None and up[0] == kmax
        rows.append([_label(ctx), kmax, b.scoring / G, f.scoring / G, f.level1 / G, b.total / G,
                     f"{up[1]} ({_pct(b.total / G, up[1])})" if up_ok else "-", f.total / G,
                     f"{up[2]} ({_pct(f.total / G, up[2])})" if up_ok else "-", f"{f.total / b.total:.2f}x",
                     f"{up[2] / up[1]:.2f}x" if up_ok else "-"])
        out.append({"ctx": ctx, "kmax": kmax, "chunks": n_chunks(ctx, s), "baseline": dataclasses.asdict(b),
                    "flashmemory": dataclasses.asdict(f), "upstream": up if up_ok else None})
    _table("Per-decode-token GFLOP (indexer scoring = 21 c4 layers x chunks x (64x128 + 64) MACs x 2)",
           ["ctx", "KMAX", "base score", "FM L2 score", "FM L1/tau", "baseline", "upstream", "FlashMemory",
            "upstream", "FM/base", "upstream"], rows)
    return {"constant_gflop": b0.constant / G, "cases": out}


def assumption_report(cases: list[tuple[int, int]]) -> dict[str, Any]:
    """Re-run the model under other counting rules and show how far each lands from upstream's table."""
    known = [(c, k) for c, k in cases if c in UPSTREAM and UPSTREAM[c][0] == k]
    if not known:
        return {}
    variants = {
        "default (2 FLOP/MAC, L1 counted, no attention core)": CountRules(),
        "1 FLOP/MAC": CountRules(flops_per_mac=1),
        "Level 1 not counted": CountRules(count_level1=False),
        "attention core counted (both columns)": CountRules(count_attention_core=True),
        "no weighting MACs, no mHC": CountRules(count_weighting=False, count_hc=False),
    }
    rows, res = [], {}
    for name, rules in variants.items():
        devs = []
        for ctx, kmax in known:
            up = UPSTREAM[ctx]
            devs += [baseline_flops(ctx, rules=rules).total / G / up[1] - 1,
                     flashmemory_flops(ctx, kmax, rules=rules).total / G / up[2] - 1]
        worst = max(devs, key=abs)
        res[name] = devs
        rows.append([name, " ".join(f"{100 * d:+.1f}" for d in devs), f"{100 * worst:+.1f}%",
                     "yes" if abs(worst) <= 0.05 else "NO"])
    _table("Which counting rule reproduces upstream (deviation %, base/FM per context)",
           ["rule", "deviations", "worst", "within 5%"], rows)
    xs = [n_chunks(c) * FlashShape().n_c4 for c, _ in known]
    icpt, slope = fit_line(xs, [UPSTREAM[c][1] * G for c, _ in known])
    b = baseline_flops(known[0][0])
    # residual FLOPs -> (chunk x layer) pairs -> chunks -> tokens
    extra_tokens = (icpt - UPSTREAM_CONSTANT_GFLOP * G) / slope / FlashShape().n_c4 * FlashShape().c4_ratio
    core = attention_core_terms(known[0][0], FlashShape())
    print(f"\n  Upstream baseline column as a line: {icpt / G:.2f} GFLOP + {slope:.0f} FLOP per (chunk x c4 layer).\n"
          f"  Our slope is {2 * (64 * 128 + 64)} (= 2 x (64x128 + 64)); our constant {b.constant / G:.2f}.\n"
          f"  Upstream's baseline carries a context-independent {icpt / G - UPSTREAM_CONSTANT_GFLOP:.2f} GFLOP beyond "
          f"its stated 26.6 that its FlashMemory column lacks.\n  Candidates (not verifiable without their script): "
          f"top-512 QK+PV at the 21 c4 layers = {2 * 512 * 2 * 64 * 512 * 21 / G:.2f} GFLOP "
          f"(with SWA {core[0].flops(CountRules()) / G:.2f}); or ~{extra_tokens / 1024:.0f}K "
          f"extra history tokens scored.\n  We do not add it: the model stays within 5% without it (see table).")
    return {"variants": res, "upstream_baseline_fit": {"intercept_gflop": icpt / G, "flop_per_chunk_layer": slope}}


def byte_report(cases: list[tuple[int, int]], knobs_for: Any) -> dict[str, Any]:
    rows, out = [], []
    for ctx, kmax in cases:
        kn = knobs_for(ctx)
        for rb in (baseline_bytes(ctx), flashmemory_bytes(ctx, kmax, kn), hisparse_bytes(ctx, kmax, kn)):
            name = rb.policy + (" (Path-I)" if rb.policy == "flashmemory" and kn.path_i else "")
            rows.append([_label(ctx), name, rb.device / G, rb.host / G, rb.hbm_read_step / M, rb.pcie_step / M,
                         rb.recall_cycle / M])
            out.append({"ctx": ctx, "kmax": kmax, **dataclasses.asdict(rb)})
        rows.append(["", "all-miss swap-in", "", "", "", all_miss_bytes(ctx) / M, ""])
    _table("Bytes per request (device/host GB; HBM read and PCIe per decode step MB; recall per 64-step cycle MB)",
           ["ctx", "policy", "device GB", "host GB", "HBM rd/step MB", "PCIe/step MB", "per cycle MB"], rows)
    b = baseline_bytes(1048576)
    parts = ", ".join(f"{k} {v / G:.3f} GB" for k, v in b.device_parts.items())
    print(f"\n  Device KV breakdown, baseline 1M: {parts}"
          f"  (= {b.device / 2**30:.2f} GiB; upstream's README says 3.73 -> 0.37 GB at 1M).")
    return {"requests": out}


def throughput_report(cases: list[tuple[int, int]], knobs_for: Any, hw: Hardware, overhead_ms: float) -> dict:
    wb = weight_bytes()
    print(f"\nTHROUGHPUT ESTIMATE (not measured). 8xH20 TP8: HBM {hw.hbm_gb:g} GB @ {hw.hbm_tbps:g} TB/s, PCIe "
          f"{hw.pcie_gbps:g} GB/s, {hw.tflops:g} TFLOP/s x mfu {hw.mfu:g}; weights {wb.total / G:.0f} GB "
          f"(routed FP4 {wb.routed / G:.0f} + rest {wb.other / G:.1f}), mem fraction {hw.mem_fraction:g} -> KV budget "
          f"{kv_budget_per_gpu(hw) / G:.1f} GB/GPU; KV replicated per rank; host {hw.host_ram_gb:g} GB x "
          f"{hw.host_fraction:g} for per-rank mirrors; max-running {hw.max_running}.")
    hw_over = dataclasses.replace(hw, overhead_ms=overhead_ms)
    rows, out = [], []
    for ctx, kmax in cases:
        kn = knobs_for(ctx)
        bf, ff = baseline_flops(ctx).total, flashmemory_flops(ctx, kmax).total
        up = UPSTREAM.get(ctx) if UPSTREAM.get(ctx, (None,))[0] == kmax else None
        per = [(baseline_bytes(ctx), bf, False, up[3:5] if up else None),
               (flashmemory_bytes(ctx, kmax, kn), ff, False, up[5:7] if up else None),
               (hisparse_bytes(ctx, kmax, kn), bf, True, None)]
        base_tok0 = base_conc = None
        for rb, fl, sync, upv in per:
            e, e0 = estimate(rb, fl, hw, sync_pcie=sync), estimate(rb, fl, hw_over, sync_pcie=sync)
            if rb.policy == "baseline":
                base_tok0, base_conc = e0.tok_s, e.conc
            rows.append([_label(ctx), rb.policy, f"{e.conc} ({e.bound})", f"{e.conc / base_conc:.1f}x",
                         f"{e.hbm_ms:.1f}/{e.compute_ms:.1f}/{e.pcie_ms:.1f}", f"{e.tok_s:.0f}",
                         f"{e0.tok_s:.0f}", f"{e0.tok_s / base_tok0:.1f}x",
                         f"{upv[0]} / {upv[1]}" if upv else "-", f"{1e3 * upv[0] / upv[1]:.1f}" if upv else "-"])
            out.append({"ctx": ctx, "kmax": kmax, "roofline": dataclasses.asdict(e),
                        "with_overhead": dataclasses.asdict(e0), "upstream_conc_tok_s": upv})
    _table(f"Estimated ceiling and aggregate decode tok/s (roofline, and with +{overhead_ms:g} ms fixed per step)",
           ["ctx", "policy", "conc (bound)", "vs base", "HBM/FLOP/PCIe ms", "tok/s roof", f"tok/s +{overhead_ms:g}ms",
            "vs base", "upstream conc/tok/s", "upstream ms/step"], rows)
    print("  Upstream's own step times (conc / tok/s) are 24-30 ms for both systems, 4-6x the roofline: the fixed\n"
          "  cost (86 TP all-reduces per token, launches, scheduler, sparse-kernel efficiency) is not modelled, so\n"
          "  the +overhead column is the better guide. Upstream's FlashMemory concurrency is held below the model's\n"
          "  ceiling by its cuda-graph bug above batch ~80 and recall quality at 512K; its 1M KMAX=384 row runs 30.")
    return {"hardware": dataclasses.asdict(hw), "overhead_ms": overhead_ms, "estimates": out}


def _atomic_json(path: str, obj: Any) -> None:
    from flashmemory.atomic import atomic_write_text
    atomic_write_text(path, json.dumps(obj, indent=1, default=str))


def run(args: argparse.Namespace) -> int:
    try:
        cases = _parse_contexts(args.contexts)
        hw = Hardware(hbm_gb=args.hbm_gb, hbm_tbps=args.hbm_tbps, pcie_gbps=args.pcie_gbps, tflops=args.tflops,
                      mfu=args.mfu, mem_fraction=args.mem_fraction, weights_gb=args.weights_gb,
                      host_ram_gb=args.host_ram_gb, host_fraction=args.host_fraction)
        if not 0 <= args.turnover <= 1 or not 0 <= args.hisparse_miss <= 1:
            raise ValueError("--turnover and --hisparse-miss must lie in [0, 1]")
        if args.overhead_ms < 0:
            raise ValueError("--overhead-ms must be >= 0")
    except ValueError as e:
        print(f"costmodel: {e}")
        return 2

    def knobs_for(ctx: int) -> PolicyKnobs:
        path_i = {"on": True, "off": False}.get(args.path_i, ctx >= 1048576)
        return PolicyKnobs(path_i=path_i, turnover=args.turnover, hisparse_miss=args.hisparse_miss)

    report = {"flops": flop_report(cases), "assumptions": assumption_report(cases),
              "bytes": byte_report(cases, knobs_for),
              "throughput": throughput_report(cases, knobs_for, hw, args.overhead_ms)}
    if args.json:
        _atomic_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0
