"""`flashmemory bench peers`: rounds -> per (context, arm) summary -> the side-by-side table (plain text and the
README's Markdown). Pure: reads the JSON the bench wrote, so the README table is regenerated from the committed run
(`python -m flashmemory.bench.peers_report docs/bench/peers.json`)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashmemory.bench.peers_costs import ARM_NAMES, Knobs, Shape, arm_label, arm_order, device_bytes, entries, spread

COST_KEYS = ("h2d_bytes", "prefetch_bytes", "hit_rate", "transfer_ops", "moved_entries", "scored_entries")


def _median(xs: Sequence[float]) -> float:
    return spread(xs)["median"]


def summarize(rounds: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (context, arm key), contexts ascending, arms in ARMS order (a hot-buffer arm's sizes ascending).

    Counted costs and device bytes: the median over rounds (a cost a round did not record, as in runs made before
    the key existed, is NaN: 'n/a' in the table). Tokens equal to stock: summed over rounds. Timing:
    steady tok/s and its ratio to the stock arm of the same round and context (interleaved, so the box's load
    cancels), each as median/min/max over rounds; ITL and sglang's per-step decode time as medians."""
    rows = []
    for ctx in sorted({int(r["ctx"]) for r in rounds}):
        stock = {r["round"]: r for r in rounds if r["ctx"] == ctx and r["arm"] == "stock"}
        for arm in sorted({r["arm"] for r in rounds if r["ctx"] == ctx}, key=arm_order):
            mine = [r for r in rounds if r["ctx"] == ctx and r["arm"] == arm]
            ratios = [
                r["steady_tok_s"] / stock[r["round"]]["steady_tok_s"]
                for r in mine
                if r["round"] in stock and stock[r["round"]]["steady_tok_s"] > 0
            ]
            eq, cmp = sum(r.get("eq", 0) for r in mine), sum(r.get("cmp", 0) for r in mine)
            steps = [s for r in mine for s in r.get("step_ms", [])]
            rows.append(
                {
                    "ctx": ctx,
                    "arm": arm,
                    "rounds": len(mine),
                    "costs": {k: _median([r["costs"].get(k, float("nan")) for r in mine]) for k in COST_KEYS},
                    "device": {k: _median([r["device"][k] for r in mine]) for k in ("c4_kv", "index_k", "reserve")},
                    "tokens_equal": eq / cmp if cmp else float("nan"),
                    "tokens_compared": cmp,
                    "steady_tok_s": spread([r["steady_tok_s"] for r in mine]),
                    "vs_stock": spread(ratios),
                    "itl_ms": _median([r["itl_ms"] for r in mine]),
                    "step_ms": _median(steps),
                }
            )
    return rows


def _f(x: float, fmt: str) -> str:
    return "n/a" if not isinstance(x, (int, float)) or not math.isfinite(x) else format(x, fmt)


def _range(s: Mapping[str, float], fmt: str) -> str:
    if not s.get("n"):
        return "n/a"
    if s["n"] == 1:
        return _f(s["median"], fmt)
    return f"{_f(s['median'], fmt)} ({_f(s['min'], fmt)}-{_f(s['max'], fmt)})"


HEAD = [
    "context",
    "arm",
    "hit rate",
    "on-demand H2D KB/token",
    "prefetched KB/token",
    "transfer ops/token",
    "entries moved/token",
    "entries scored/token",
    "device KB/request: c4 KV + index-K + reserve",
    "tokens = stock",
    "steady tok/s",
    "vs stock",
    "ITL ms",
    "step ms",
]


def table_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """The table's cells, one list per summary row (HEAD's columns)."""
    out = []
    for r in rows:
        c, d = dict.fromkeys(COST_KEYS, float("nan")) | dict(r["costs"]), r["device"]
        dev = (
            f"{_f((d['c4_kv'] + d['index_k'] + d['reserve']) / 1e3, '.0f')} "
            f"({_f(d['c4_kv'] / 1e3, '.0f')} + {_f(d['index_k'] / 1e3, '.0f')} + {_f(d['reserve'] / 1e3, '.0f')})"
        )
        eq = "n/a" if not r["tokens_compared"] else f"{_f(r['tokens_equal'], '.3f')} of {r['tokens_compared']}"
        out.append(
            [
                f"{r['ctx']:,}",
                arm_label(r["arm"]),
                _f(c["hit_rate"], ".3f"),
                _f(c["h2d_bytes"] / 1e3, ".1f"),
                _f(c["prefetch_bytes"] / 1e3, ".1f"),
                _f(c["transfer_ops"], ".2f"),
                _f(c["moved_entries"], ".0f"),
                _f(c["scored_entries"], ".0f"),
                dev,
                eq,
                _range(r["steady_tok_s"], ".2f"),
                _range(r["vs_stock"], ".2f"),
                _f(r["itl_ms"], ".0f"),
                _f(r["step_ms"], ".0f"),
            ]
        )
    return out


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The side-by-side table as Markdown (the README's measured table)."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    return "\n".join(lines)


def plain(rows: Sequence[Mapping[str, Any]]) -> str:
    """The side-by-side table as right-aligned plain text (the bench's printout)."""
    cells = [HEAD] + table_rows(rows)
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEAD))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def curve_markdown(shape: Shape, knobs: Knobs, contexts: Sequence[int]) -> str:
    """How the config-determined costs diverge with history length (arithmetic, nothing measured): per arm and
    context, device KB per request of the c4 state and the c4 entries the indexers score per token. FlashMemory's
    Level 1 is counted as its retriever layers over the history once per `knobs.interval` steps; its resident set
    as KMAX pages (no escalation)."""
    lines = [
        "| context | arm | device KB/request (c4 KV + index-K + reserve) | entries scored/token |",
        "|---|---|---|---|",
    ]
    for ctx in contexts:
        n = entries(ctx, shape)
        for arm in ("stock", "hisparse", "flashmemory"):
            d = device_bytes(arm, ctx, shape, knobs)
            if arm == "flashmemory":
                scored = shape.n_c4 * min(n, knobs.kmax * 64) + knobs.retriever_layers * n / knobs.interval
            else:
                scored = float(shape.n_c4 * n)
            lines.append(
                f"| {ctx:,} | {ARM_NAMES[arm]} | {sum(d.values()) / 1e3:.0f} ({d['c4_kv'] / 1e3:.0f} + "
                f"{d['index_k'] / 1e3:.0f} + {d['reserve'] / 1e3:.0f}) | {scored:.0f} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the Markdown table of a peers JSON (`flashmemory bench peers --out`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m flashmemory.bench.peers_report PEERS.json", file=sys.stderr)
        return 2
    try:
        data = json.loads(Path(args[0]).read_text())
        rows = data["summary"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args[0]}: not a peers JSON ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
