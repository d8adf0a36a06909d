"""The FLOP, assumption and byte tables of `flashmemory bench costmodel`: per-token FLOPs and per-request bytes of
stock, HiSparse and FlashMemory next to upstream's README tables, and the assumptions they rest on. Pure
`flashmemory.costmodel` arithmetic, printed; nothing is timed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashmemory.bench.costmodel_calibrated import ctx_label
from flashmemory.bench.table import print_table
from flashmemory.costmodel import (
    UPSTREAM,
    UPSTREAM_CONSTANT_GFLOP,
    CountRules,
    FlashShape,
    HiSparseKnobs,
    RetrieverShape,
    all_miss_bytes,
    attention_core_terms,
    baseline_bytes,
    baseline_flops,
    fit_line,
    flashmemory_bytes,
    flashmemory_flops,
    hisparse_bytes,
    n_chunks,
)

G, M = 1e9, 1e6


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.1f}%"


def flop_report(cases: list[tuple[int, int]], rules: CountRules = CountRules()) -> dict[str, Any]:
    s, r = FlashShape(), RetrieverShape()
    b0 = baseline_flops(cases[0][0], s, r, rules)
    const_rows = [[t.name, t.note, t.count, t.flops(rules) / G] for t in b0.terms if t.name != "indexer scoring"]
    print_table(
        f"Constant part per decode token ({rules.flops_per_mac} FLOP/MAC): ours {b0.constant / G:.2f} GFLOP vs "
        f"upstream {UPSTREAM_CONSTANT_GFLOP} ({_pct(b0.constant / G, UPSTREAM_CONSTANT_GFLOP)})",
        ["term", "shape", "x layers", "GFLOP"],
        const_rows,
    )
    rows, out = [], []
    for ctx, kmax in cases:
        b, f = baseline_flops(ctx, s, r, rules), flashmemory_flops(ctx, kmax, s, r, rules)
        up = UPSTREAM.get(ctx)
        up_ok = up is not None and up[0] == kmax
        rows.append(
            [
                ctx_label(ctx),
                kmax,
                b.scoring / G,
                f.scoring / G,
                f.level1 / G,
                b.total / G,
                f"{up[1]} ({_pct(b.total / G, up[1])})" if up_ok else "-",
                f.total / G,
                f"{up[2]} ({_pct(f.total / G, up[2])})" if up_ok else "-",
                f"{f.total / b.total:.2f}x",
                f"{up[2] / up[1]:.2f}x" if up_ok else "-",
            ]
        )
        out.append(
            {
                "ctx": ctx,
                "kmax": kmax,
                "chunks": n_chunks(ctx, s),
                "baseline": dataclasses.asdict(b),
                "flashmemory": dataclasses.asdict(f),
                "upstream": up if up_ok else None,
            }
        )
    print_table(
        "Per-decode-token GFLOP (indexer scoring = 21 c4 layers x chunks x (64x128 + 64) MACs x 2)",
        [
            "ctx",
            "KMAX",
            "base score",
            "FM L2 score",
            "FM L1/tau",
            "baseline",
            "upstream",
            "FlashMemory",
            "upstream",
            "FM/base",
            "upstream",
        ],
        rows,
    )
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
            devs += [
                baseline_flops(ctx, rules=rules).total / G / up[1] - 1,
                flashmemory_flops(ctx, kmax, rules=rules).total / G / up[2] - 1,
            ]
        worst = max(devs, key=abs)
        res[name] = devs
        rows.append(
            [
                name,
                " ".join(f"{100 * d:+.1f}" for d in devs),
                f"{100 * worst:+.1f}%",
                "yes" if abs(worst) <= 0.05 else "NO",
            ]
        )
    print_table(
        "Which counting rule reproduces upstream (deviation %, base/FM per context)",
        ["rule", "deviations", "worst", "within 5%"],
        rows,
    )
    xs = [n_chunks(c) * FlashShape().n_c4 for c, _ in known]
    icpt, slope = fit_line(xs, [UPSTREAM[c][1] * G for c, _ in known])
    b = baseline_flops(known[0][0])
    # residual FLOPs -> (chunk x layer) pairs -> chunks -> tokens
    extra_tokens = (icpt - UPSTREAM_CONSTANT_GFLOP * G) / slope / FlashShape().n_c4 * FlashShape().c4_ratio
    core = attention_core_terms(known[0][0], FlashShape())
    print(
        f"\n  Upstream baseline column as a line: {icpt / G:.2f} GFLOP + {slope:.0f} FLOP per (chunk x c4 layer).\n"
        f"  Our slope is {2 * (64 * 128 + 64)} (= 2 x (64x128 + 64)); our constant {b.constant / G:.2f}.\n"
        f"  Upstream's baseline carries a context-independent {icpt / G - UPSTREAM_CONSTANT_GFLOP:.2f} GFLOP beyond "
        f"its stated 26.6 that its FlashMemory column lacks.\n  Candidates (not verifiable without their script): "
        f"top-512 QK+PV at the 21 c4 layers = {2 * 512 * 2 * 64 * 512 * 21 / G:.2f} GFLOP "
        f"(with SWA {core[0].flops(CountRules()) / G:.2f}); or ~{extra_tokens / 1024:.0f}K "
        f"extra history tokens scored.\n  We do not add it: the model stays within 5% without it (see table)."
    )
    return {"variants": res, "upstream_baseline_fit": {"intercept_gflop": icpt / G, "flop_per_chunk_layer": slope}}


def byte_report(cases: list[tuple[int, int]], knobs_for: Any, hs: HiSparseKnobs) -> dict[str, Any]:
    rows, out = [], []
    for ctx, kmax in cases:
        kn = knobs_for(ctx)
        for rb in (baseline_bytes(ctx), flashmemory_bytes(ctx, kmax, kn), hisparse_bytes(ctx, hs)):
            name = rb.policy + (" (Path-I)" if rb.policy == "flashmemory" and kn.path_i else "")
            rows.append(
                [
                    ctx_label(ctx),
                    name,
                    rb.device / G,
                    rb.host / G,
                    rb.hbm_read_step / M,
                    rb.pcie_step / M,
                    rb.recall_cycle / M,
                ]
            )
            out.append({"ctx": ctx, "kmax": kmax, **dataclasses.asdict(rb)})
        rows.append(["", "all-miss swap-in", "", "", "", all_miss_bytes(ctx) / M, ""])
    print_table(
        "Bytes per request (device/host GB; HBM read and PCIe per decode step MB; recall per 64-step cycle MB)",
        ["ctx", "policy", "device GB", "host GB", "HBM rd/step MB", "PCIe/step MB", "per cycle MB"],
        rows,
    )
    b = baseline_bytes(1048576)
    parts = ", ".join(f"{k} {v / G:.3f} GB" for k, v in b.device_parts.items())
    print(
        f"\n  Device KV breakdown, baseline 1M: {parts}"
        f"  (= {b.device / 2**30:.2f} GiB; upstream's README says 3.73 -> 0.37 GB at 1M)."
    )
    return {"requests": out}
