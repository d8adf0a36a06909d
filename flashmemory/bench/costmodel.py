"""`flashmemory bench costmodel`: per-token FLOPs, per-request bytes and a throughput ESTIMATE for
DeepSeek-V4-Flash decode, baseline vs FlashMemory vs sglang's own HiSparse, next to upstream's README tables; a
stock / HiSparse / FlashMemory table for 8xH20 at 128K-1M x 1-64 requests, and the model checked against HiSparse's
published 2xB200 figure.

All numbers come from `flashmemory.costmodel` (analytic, nothing is timed); ratios are FlashMemory / baseline
computed in the same run. `--quick` is accepted for `bench all` and changes nothing (the model is instant).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from flashmemory.costmodel import (UPSTREAM, UPSTREAM_CONSTANT_GFLOP, CountRules, FlashShape, Hardware, HiSparseKnobs,
                                   PolicyKnobs, RetrieverShape, all_miss_bytes, attention_core_terms, baseline_bytes,
                                   baseline_flops, estimate, fit_line, flashmemory_bytes, flashmemory_flops,
                                   hisparse_bytes, kv_budget_per_gpu, n_chunks, weight_bytes)
from flashmemory.costmodel.peers import B200_PAIR, PublishedFigure, check_published, peer_table
from flashmemory.bench.table import print_table
from flashmemory.bench.costmodel_disk import add_disk_args, disk_knobs, disk_report

G, M = 1e9, 1e6
DEFAULT_CTX = "262144:96,524288:192,1048576:384"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default=DEFAULT_CTX, help=f"ctx:KMAX pairs, comma separated (default {DEFAULT_CTX})")
    p.add_argument("--path-i", choices=("auto", "on", "off"), default="auto",
                   help="offload the 18 non-retriever layers' index keys (auto: on at >= 1M, as upstream)")
    p.add_argument("--turnover", type=float, default=1.0,
                   help="fraction of the resident set replaced per Level-1 cycle (default 1.0 = worst case)")
    p.add_argument("--hisparse-miss", type=float, default=0.05,
                   help="HiSparse: fraction of the per-step top-512 that misses the hot buffer, i.e. 1 - hit rate "
                        "(default 0.05: IndexCache's >=95%% adjacent-step overlap; not measured on V4. Measured live "
                        "on the random-weight serving-tiny model, 512 slots, after the cold first step: 0.07 at a "
                        "550-entry history, 0.32 at 750)")
    p.add_argument("--hisparse-buffer", type=int, default=HiSparseKnobs().device_buffer_size,
                   help="HiSparse device_buffer_size in c4 slots per layer (default 4096, sglang's default)")
    p.add_argument("--hisparse-step-ms", type=float, default=0.0,
                   help="HiSparse fixed cost per decode step beyond its bytes (default 0)")
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


def _label(ctx: int) -> str:
    return f"{ctx // 1048576}M" if ctx % 1048576 == 0 else f"{ctx // 1024}K"


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.1f}%"


def flop_report(cases: list[tuple[int, int]], rules: CountRules = CountRules()) -> dict[str, Any]:
    s, r = FlashShape(), RetrieverShape()
    b0 = baseline_flops(cases[0][0], s, r, rules)
    const_rows = [[t.name, t.note, t.count, t.flops(rules) / G] for t in b0.terms if t.name != "indexer scoring"]
    print_table(f"Constant part per decode token ({rules.flops_per_mac} FLOP/MAC): ours {b0.constant / G:.2f} GFLOP vs "
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
    print_table("Per-decode-token GFLOP (indexer scoring = 21 c4 layers x chunks x (64x128 + 64) MACs x 2)",
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
    print_table("Which counting rule reproduces upstream (deviation %, base/FM per context)",
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


def byte_report(cases: list[tuple[int, int]], knobs_for: Any, hs: HiSparseKnobs) -> dict[str, Any]:
    rows, out = [], []
    for ctx, kmax in cases:
        kn = knobs_for(ctx)
        for rb in (baseline_bytes(ctx), flashmemory_bytes(ctx, kmax, kn), hisparse_bytes(ctx, hs)):
            name = rb.policy + (" (Path-I)" if rb.policy == "flashmemory" and kn.path_i else "")
            rows.append([_label(ctx), name, rb.device / G, rb.host / G, rb.hbm_read_step / M, rb.pcie_step / M,
                         rb.recall_cycle / M])
            out.append({"ctx": ctx, "kmax": kmax, **dataclasses.asdict(rb)})
        rows.append(["", "all-miss swap-in", "", "", "", all_miss_bytes(ctx) / M, ""])
    print_table("Bytes per request (device/host GB; HBM read and PCIe per decode step MB; recall per 64-step cycle MB)",
           ["ctx", "policy", "device GB", "host GB", "HBM rd/step MB", "PCIe/step MB", "per cycle MB"], rows)
    b = baseline_bytes(1048576)
    parts = ", ".join(f"{k} {v / G:.3f} GB" for k, v in b.device_parts.items())
    print(f"\n  Device KV breakdown, baseline 1M: {parts}"
          f"  (= {b.device / 2**30:.2f} GiB; upstream's README says 3.73 -> 0.37 GB at 1M).")
    return {"requests": out}


def throughput_report(cases: list[tuple[int, int]], knobs_for: Any, hw: Hardware, overhead_ms: float,
                      hs: HiSparseKnobs) -> dict:
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
               (hisparse_bytes(ctx, hs), bf, True, None)]
        base_tok0 = base_conc = None
        for rb, fl, sync, upv in per:
            x = hs.step_overhead_ms if rb.policy == "hisparse" else 0.0
            e = estimate(rb, fl, hw, sync_pcie=sync, extra_ms=x)
            e0 = estimate(rb, fl, hw_over, sync_pcie=sync, extra_ms=x)
            if rb.policy == "baseline":
                base_tok0, base_conc = e0.tok_s, e.conc
            rows.append([_label(ctx), rb.policy, f"{e.conc} ({e.bound})", f"{e.conc / base_conc:.1f}x",
                         f"{e.hbm_ms:.1f}/{e.compute_ms:.1f}/{e.pcie_ms:.1f}", f"{e.tok_s:.0f}",
                         f"{e0.tok_s:.0f}", f"{e0.tok_s / base_tok0:.1f}x",
                         f"{upv[0]} / {upv[1]}" if upv else "-", f"{1e3 * upv[0] / upv[1]:.1f}" if upv else "-"])
            out.append({"ctx": ctx, "kmax": kmax, "roofline": dataclasses.asdict(e),
                        "with_overhead": dataclasses.asdict(e0), "upstream_conc_tok_s": upv})
    print_table(f"Estimated ceiling and aggregate decode tok/s (roofline, and with +{overhead_ms:g} ms fixed per step)",
           ["ctx", "policy", "conc (bound)", "vs base", "HBM/FLOP/PCIe ms", "tok/s roof", f"tok/s +{overhead_ms:g}ms",
            "vs base", "upstream conc/tok/s", "upstream ms/step"], rows)
    print("  Upstream's own step times (conc / tok/s) are 24-30 ms for both systems, 4-6x the roofline: the fixed\n"
          "  cost (86 TP all-reduces per token, launches, scheduler, sparse-kernel efficiency) is not modelled, so\n"
          "  the +overhead column is the better guide. Upstream's FlashMemory concurrency is held below the model's\n"
          "  ceiling by its cuda-graph bug above batch ~80 and recall quality at 512K; its 1M KMAX=384 row runs 30.")
    return {"hardware": dataclasses.asdict(hw), "overhead_ms": overhead_ms, "estimates": out}


def _tok(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def peer_report(hw: Hardware, hs: HiSparseKnobs, knobs_for: Any, overhead_ms: float) -> dict[str, Any]:
    """Stock / HiSparse / FlashMemory on `hw` at 128K, 256K, 1M x 1, 16, 64 requests (projection)."""
    cells = peer_table(hw, hs, fm_knobs=knobs_for, overhead_ms=overhead_ms)
    rows = []
    for c in cells:
        parts = c.device_parts
        c4 = parts.get("c4 kv", parts.get("c4 hot buffer", 0.0))
        rows.append([_label(c.ctx), c.policy + (f" KMAX {c.kmax}" if c.policy == "flashmemory" else ""),
                     c.device_bytes / G, c4 / G, parts["index keys"] / G, f"{c.max_conc} ({c.bound})"]
                    + [f"{_tok(c.tok_s_roof[b])} / {_tok(c.tok_s[b])}" for b in sorted(c.tok_s)])
    print_table(f"PROJECTED stock vs HiSparse vs FlashMemory, {hw.n_gpus}xH20 (not measured): device GB per request, "
           f"ceiling, tok/s roofline / +{overhead_ms:g} ms per step ('-': does not fit)",
           ["ctx", "arm", "device GB", "c4 GB", "index-K GB", "max conc"] + [f"{b} req tok/s" for b in sorted(
               cells[0].tok_s)], rows)
    print(f"  HiSparse: device_buffer_size {hs.device_buffer_size} (+{hs.buffer_page}) c4 slots per layer, hit "
          f"rate {hs.hit_rate:g} (a knob: nobody has measured it on V4; the tiny model's live miss rate after the "
          f"cold first step was 0.07-0.32, README), index keys and c128 stay on the device, "
          f"swap-in is synchronous.\n  FlashMemory: KMAX scaled from upstream's 96 at 256K, Path-I at 1M, "
          f"worst-case turnover; recall overlapped. Quality differs: HiSparse is exact, FlashMemory is lossy.")
    return {"hardware": dataclasses.asdict(hw), "hisparse": dataclasses.asdict(hs), "overhead_ms": overhead_ms,
            "cells": [dataclasses.asdict(c) for c in cells]}


def published_report(hs: HiSparseKnobs, overhead_ms: float) -> dict[str, Any]:
    """The model on HiSparse's published DeepSeek-V4-Flash workload with B200 constants: how far off, and why."""
    fig, hw = PublishedFigure(), B200_PAIR
    over = dataclasses.replace(hw, overhead_ms=overhead_ms)
    main = f"+{overhead_ms:g} ms/step"
    variants = {"roofline": (hw, hs), main: (over, hs),
                f"+{overhead_ms:g} ms, HiSparse +7.5 ms": (over, dataclasses.replace(hs, step_overhead_ms=7.5))}
    res = {name: check_published(h, k, fig) for name, (h, k) in variants.items()}
    w_gb = round(res[main].implied_weights_gb)
    res[f"{main}, weights {w_gb} GB"] = check_published(dataclasses.replace(over, weights_gb=float(w_gb)), hs, fig)
    rows = [[name, f"{r.stock_conc} / {r.hisparse_conc}", f"{r.stock_tok_s:.0f}", f"{r.hisparse_tok_s:.0f}",
             f"{r.speedup:.2f}x", f"{100 * r.off_generation:+.0f}%", f"{100 * r.off_decode:+.0f}%",
             r.implied_stock_conc, f"{r.implied_budget_gb:.1f}", f"{r.implied_weights_gb:.0f}"]
            for name, r in res.items()]
    print_table(f"CHECK vs HiSparse's published figure: DeepSeek-V4-Flash, 2xB200, {fig.prompt // 1024}K in / "
           f"{fig.output // 1024}K out, {fig.concurrency} concurrent: {fig.stock_tok_s:.0f} -> "
           f"{fig.hisparse_tok_s:.0f} tok/s ({fig.generation_speedup}x generation, {fig.decode_speedup}x decode-only)",
           ["model", "admitted stock/HiSp", "stock tok/s", "HiSp tok/s", "HiSp/stock", "off (2.1x)", "off (2.9x)",
            "implied stock batch", "its KV GB/GPU", "implied weights GB"], rows)
    r = res[main]
    lines = [
        f"B200 constants: {hw.n_gpus} GPUs, {hw.hbm_gb:g} GB @ {hw.hbm_tbps:g} TB/s, {hw.tflops:g} TFLOP/s, PCIe "
        f"{hw.pcie_gbps:g} GB/s; weights {weight_bytes().total / G:.0f} GB -> KV budget {r.kv_budget_gb:.1f} GB/GPU.",
        f"How far off ({main}): the model gives HiSparse {r.speedup:.2f}x where the paper reports "
        f"{fig.generation_speedup}x ({100 * r.off_generation:+.0f}%) and {fig.decode_speedup}x decode-only "
        f"({100 * r.off_decode:+.0f}%).",
        f"Why: in the model stock is not capacity-bound here ({fig.concurrency} requests x "
        f"{r.stock_device_gb:.3f} GB = {fig.concurrency * r.stock_device_gb:.1f} of {r.kv_budget_gb:.0f} GB per GPU),",
        "so HiSparse cannot win by admitting more; it scores the same full history and adds a synchronous swap-in.",
        f"The paper's stock TTFT (829 s vs 171 s) suggests stock queued: its ratio implies stock decoded only "
        f"~{r.implied_stock_conc} requests at once,",
        f"~{r.implied_budget_gb:.1f} GB of KV per GPU, as if the weights took {r.implied_weights_gb:.0f} GB (about an "
        f"FP8 copy of all ~284B parameters)",
        "or sglang's pool split (fixed c4/c128/SWA/indexer/compress-state ratios, graph and activation reserves) left",
        "stock that little (last row: with that budget both arms are capacity-bound and the ratio moves toward the",
        "paper's). The model has no pool configurator, no prefill and no PD transfer; its absolute tok/s",
        f"({r.stock_tok_s:.0f} stock) is {r.stock_tok_s / fig.stock_tok_s:.1f}x the paper's. The published figures "
        f"are secondary summaries, unchecked.",
    ]
    print("\n".join("  " + s for s in lines))
    return {"figure": dataclasses.asdict(fig), "hardware": dataclasses.asdict(hw),
            "variants": {name: dataclasses.asdict(v) for name, v in res.items()}}


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
        if args.hisparse_buffer < FlashShape().index_topk:
            raise ValueError(f"--hisparse-buffer {args.hisparse_buffer}: must be >= index_topk "
                             f"{FlashShape().index_topk} (sglang refuses a smaller hot buffer)")
        if not args.hisparse_step_ms >= 0:
            raise ValueError("--hisparse-step-ms must be >= 0")
        hs = HiSparseKnobs(device_buffer_size=args.hisparse_buffer, hit_rate=1.0 - args.hisparse_miss,
                           step_overhead_ms=args.hisparse_step_ms)
        if args.overhead_ms < 0:
            raise ValueError("--overhead-ms must be >= 0")
        dk = disk_knobs(args)
    except ValueError as e:
        print(f"costmodel: {e}")
        return 2

    def knobs_for(ctx: int) -> PolicyKnobs:
        path_i = {"on": True, "off": False}.get(args.path_i, ctx >= 1048576)
        return PolicyKnobs(path_i=path_i, turnover=args.turnover)

    report = {"flops": flop_report(cases), "assumptions": assumption_report(cases),
              "bytes": byte_report(cases, knobs_for, hs),
              "throughput": throughput_report(cases, knobs_for, hw, args.overhead_ms, hs),
              "peers": peer_report(hw, hs, knobs_for, args.overhead_ms),
              "hisparse_check": published_report(hs, args.overhead_ms),
              "disk": disk_report(hw, dk, hs, args.overhead_ms, args.turnover)}
    if args.json:
        _atomic_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0
