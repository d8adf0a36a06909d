"""Demo outputs: the method table (stdout and report.md), results.json, and the coverage plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from flashmemory.atomic import atomic_path, atomic_write_text

COLUMNS = [  # (key, header, format)
    ("mass", "top-k mass", "{:.3f}"),
    ("golden_recall", "golden recall", "{:.3f}"),
    ("agreement", "agree w/ Full", "{:.3f}"),
    ("resident_frac", "resident frac", "{:.3f}"),
    ("bytes_vs_full", "bytes vs Full", "{:.3f}"),
    ("recall_bytes", "recalled KiB", "{:.0f}"),
    ("level1_share", "L1 time share", "{:.3f}"),
    ("task_score", "task score", "{:.2f}"),
]

SCOPE = (
    "Quality here is a mechanics check on a tiny random-weight model: it ranks residency policies at an "
    "equal page budget and catches regressions. It is not a LongBench/RULER accuracy claim."
)
SCOPE_TRAINED = (
    "The model is a 1.9M-parameter DeepSeek-V4 trained only on these needle tasks (held-out seeds here): "
    "task accuracy is real retrieval through its c4 entries, on its own training distribution. It is "
    "not a LongBench/RULER claim. The first answer token comes from the (full) prefill; the method's "
    "resident set applies from the second decode step on."
)


INTERVAL_NOTE = (
    "Intervals: [lo, hi] is a 95% interval over documents (Wilson score interval for task accuracy, "
    "counting a document's score as its share of a success; percentile bootstrap over documents, 2000 "
    "seeded resamples, for the other rates); n = documents (a cell over fewer says n=k)."
)


QUALITY_POINTER = (
    "This is the demo's small run (a few documents per task: wide intervals). The same pipeline over 48 "
    "held-out documents per task is `flashmemory eval quality`; its committed result is "
    "docs/quality/report.md, which the README's quality tables cite."
)


def _fmt(v, fmt: str, key: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v / 1024 if key == "recall_bytes" else v)


def _nan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def interval_cell(v, ci: dict | None, fmt: str, n_row: int | None = None) -> str:
    """`v [lo, hi]` (and ` n=k` when the interval covers k != n_row documents); just `v` without an interval."""
    if _nan(v):
        return "-"
    out = fmt.format(v)
    if ci and ci.get("n") and not _nan(ci.get("lo")):
        out += f" [{fmt.format(ci['lo'])}, {fmt.format(ci['hi'])}]"
        if n_row is not None and ci["n"] != n_row:
            out += f" n={ci['n']}"
    return out


def row_n(m: dict) -> int | None:
    """Documents behind a mean row: the largest n among its intervals (None without any)."""
    ns = [v["n"] for k, v in m.items() if k.endswith("_ci") and isinstance(v, dict) and "n" in v]
    return max(ns) if ns else None


def budget_cell(m: dict) -> str:
    """The equal-budget column: "-" for a method without a search, "matched", or the mismatch with both means."""
    u = m.get("budget_unmatched")
    if not u:
        return "-"
    if not u["docs"]:
        return "matched"
    return (
        f"**NOT matched** on {u['docs']}/{u['of']} docs: mean pages {u['mean_pages']:.2f} vs "
        f"FlashMemory {u['target_pages']:.2f}"
    )


def _cell(m: dict, key: str, fmt: str, n_row: int | None) -> str:
    if f"{key}_ci" in m:
        return interval_cell(m.get(key), m[f"{key}_ci"], fmt, n_row)
    return _fmt(m.get(key), fmt, key)


def method_table(methods: dict[str, dict]) -> str:
    """A GitHub-style markdown table, one row per method: each rate with its 95% interval, n documents, and (when a
    method ran an equal-budget search) whether the budget matched, with both mean page counts where it did not."""
    budget = any("budget_unmatched" in m for m in methods.values())
    head = "| method | n | " + " | ".join(h for _, h, _ in COLUMNS) + (" | equal budget |" if budget else " |")
    sep = "|---|---:|" + "|".join("---:" for _ in COLUMNS) + ("|---|" if budget else "|")
    rows = []
    for name, m in methods.items():
        n = row_n(m)
        rows.append(
            f"| {name} | {'-' if n is None else n} | "
            + " | ".join(_cell(m, k, f, n) for k, _, f in COLUMNS)
            + (f" | {budget_cell(m)} |" if budget else " |")
        )
    return "\n".join([head, sep, *rows])


def unmatched_notes(methods: dict[str, dict], where: str = "") -> list[str]:
    """One line per method whose equal-budget search did not match on some document, with both means."""
    out = []
    for name, m in methods.items():
        u = m.get("budget_unmatched")
        if u and u["docs"]:
            out.append(
                f"- **Budget not matched{where}**: {name}'s equal-budget search found no base budget whose mean "
                f"resident pages stay within FlashMemory's on {u['docs']} of {u['of']} documents; on those its "
                f"mean resident pages are {u['mean_pages']:.2f} against FlashMemory's {u['target_pages']:.2f}, "
                "so its row there is not at an equal budget."
            )
    return out


def scope(results: dict) -> str:
    """What the quality numbers can claim: the trained tiny model's, or the random model's (mechanics only)."""
    return SCOPE_TRAINED if "trained" in results.get("model_note", "") else SCOPE


def task_tables(tb: dict) -> list[str]:
    """Markdown: each method's task accuracy (and top-k mass) at each task budget with 95% intervals and n, then
    per task. A method whose equal-budget search did not match at a budget is marked (†) with both means."""
    if not tb:
        return []
    budgets = list(tb)
    methods = [m for m in next(iter(tb.values())) if not m.startswith(("task:", "task_ci:"))]
    head = (
        "| method | n | "
        + " | ".join(f"task acc @ {float(b):.0%}" for b in budgets)
        + " | "
        + " | ".join(f"top-k mass @ {float(b):.0%}" for b in budgets)
        + " |"
    )
    lines = [head, "|---|---:|" + "---:|" * (2 * len(budgets))]
    notes = []
    for m in methods:
        n = row_n(tb[budgets[0]][m])
        mark = {b: " †" if (tb[b][m].get("budget_unmatched") or {}).get("docs") else "" for b in budgets}
        lines.append(
            f"| {m} | {'-' if n is None else n} | "
            + " | ".join(_cell(tb[b][m], "task_score", "{:.3f}", n) + mark[b] for b in budgets)
            + " | "
            + " | ".join(_cell(tb[b][m], "mass", "{:.3f}", n) + mark[b] for b in budgets)
            + " |"
        )
        for b in budgets:
            if mark[b]:
                notes += [
                    x.replace("- **Budget", "- † **Budget", 1)
                    for x in unmatched_notes({m: tb[b][m]}, f" at {float(b):.0%}")
                ]
    if notes:
        lines += ["", *notes]
    tasks = [k[5:] for k in tb[budgets[0]] if k.startswith("task:")]
    if tasks:
        lines += [
            "",
            "Per task (task accuracy "
            + " / ".join(f"@ {float(b):.0%}" for b in budgets)
            + ", each with its 95% Wilson interval):",
            "",
            "| task | n | " + " | ".join(methods) + " |",
            "|---|---:|" + "---:|" * len(methods),
        ]
        for t in tasks:
            cis = [tb[b].get(f"task_ci:{t}", {}) for b in budgets]
            ns = [c.get("n") for ci in cis for c in ci.values() if c]
            n = max(ns) if ns else None
            lines.append(
                f"| {t} | {'-' if n is None else n} | "
                + " | ".join(
                    " / ".join(
                        interval_cell(tb[b][f"task:{t}"].get(m), ci.get(m), "{:.2f}", n) for b, ci in zip(budgets, cis)
                    )
                    for m in methods
                )
                + " |"
            )
    return lines


MONITOR_COLS = [
    ("mass", "top-k mass", "{:.3f}"),
    ("golden_recall", "golden recall", "{:.3f}"),
    ("agreement", "agree w/ Full", "{:.3f}"),
    ("mean_pages", "mean pages", "{:.2f}"),
    ("resident_frac", "resident frac", "{:.3f}"),
    ("task_score", "task score", "{:.2f}"),
    ("miss_mass_mean", "miss mass", "{:.3f}"),
    ("escalations", "escalations", "{:.1f}"),
    ("fallbacks", "fallbacks", "{:.1f}"),
]


def quantiles(values: list[float], qs: tuple[float, ...] = (0.1, 0.5, 0.9)) -> list[float]:
    """Nearest-rank quantiles of a list (nan when empty)."""
    v = sorted(values)
    return [v[min(len(v) - 1, int(q * len(v)))] if v else float("nan") for q in qs]


def monitor_section(results: dict) -> list[str]:
    """FlashMemory vs FlashMemory+monitor per task, and the residency-vs-length table."""
    from flashmemory.eval.residency import residency_table

    per_task = results.get("monitor_tasks") or {}
    if not per_task:
        return []
    head = "| task | method | n | " + " | ".join(h for _, h, _ in MONITOR_COLS) + " | equal budget |"
    lines = [
        "## Miss monitor: FlashMemory vs FlashMemory+monitor",
        "",
        head,
        "|---|---|---:|" + "|".join("---:" for _ in MONITOR_COLS) + "|---|",
    ]
    notes = []
    for task, methods in per_task.items():
        for name in ("FlashMemory", "FlashMemory+monitor"):
            m = methods.get(name, {})
            n = row_n(m)
            lines.append(
                f"| {task} | {name} | {'-' if n is None else n} | "
                + " | ".join(_cell(m, k, f, n) for k, _, f in MONITOR_COLS)
                + f" | {budget_cell(m)} |"
            )
        notes += unmatched_notes({n: m for n, m in methods.items() if n == "FlashMemory+monitor"}, f" ({task})")
    if notes:
        lines += ["", *notes]
    mon = results["methods"].get("FlashMemory+monitor", {})
    q = quantiles(mon.get("miss_values", []))
    lines += [
        "",
        f"Miss mass measured by the monitor on the test documents (FlashMemory+monitor, one rotated target "
        f"layer per cycle): p10 {q[0]:.3f}, p50 {q[1]:.3f}, p90 {q[2]:.3f} over "
        f"{len(mon.get('miss_values', []))} cycles.",
        "",
        "Equal average budget: the monitored method runs at the largest base budget (and cap) whose mean "
        "resident pages over the decode steps do not exceed FlashMemory's at KMAX (`mean pages`; "
        "`flashmemory.eval.monitored`). The MRCR-like rows come from extra held-out documents. "
        f"Scope: {scope(results)}",
        "",
    ]
    res = results.get("residency")
    if res:
        cfg = results["config"]
        lines += [
            "## Resident pages per request against context length",
            "",
            f"Control document: filler text with nothing to retrieve; fixed budget KMAX = "
            f"{cfg.get('residency_kmax')} pages of {cfg['page_chunks']} chunks (cap 2 x KMAX with the monitor); "
            "mean / max over the decode steps of pages holding a resident chunk (decode region included). "
            "The second table carries the largest measured pages/KMAX ratio to serving lengths with the cost "
            "model (KMAX 96 pages of 64 chunks, 584-B c4 entries, 21 c4 layers).",
            "",
            residency_table(res["rows"], res["costmodel"]),
            "",
        ]
    return lines


def report_markdown(results: dict) -> str:
    cfg = results["config"]
    kmax = next(iter(results["methods"].values())).get("kmax")
    lines = [
        "# FlashMemory CPU demo",
        "",
        f"Model `{cfg['model']}`; {cfg['n_train']} train / {cfg['n_val']} val / {cfg['n_test']} test documents of "
        f"{cfg['doc_len']} prompt tokens + {cfg['gen_tokens']} decode steps; retriever on c4 layers "
        f"{tuple(cfg['target_layers'])}; tau = {cfg['tau']} steps; pages of {cfg['page_chunks']} chunks; "
        f"budget {cfg['budget']:.0%} of pages (KMAX = {kmax:.0f}) for every method; recency tail "
        f"{cfg['tail_chunks']} chunks.",
        "",
        results.get("model_note", ""),
        "",
        method_table(results["methods"]),
        "",
        *unmatched_notes(results["methods"]),
        "",
        INTERVAL_NOTE,
        "",
        *live_section(results),
        "## Task accuracy by page budget",
        "",
        *task_tables(results.get("task_by_budget", {})),
        "",
        QUALITY_POINTER,
        "",
        "Columns: share of Full's native top-k softmax mass (every c4 layer, every decode step) inside the resident "
        "set; share of each step's golden labels resident; greedy next-token agreement with Full (teacher-forced); "
        "resident share of visible chunks; device KV bytes against Full at DeepSeek-V4 entry sizes (584-B c4 "
        "entries, index-K); bytes recalled host -> device by the offload engine; Level-1 time over Level-1 plus "
        "decode time; task score of the teacher-forced greedy tokens.",
        "",
        f"Scope: {scope(results)}",
        "",
        "Methods: Full (all resident); FlashMemory (trained retriever, threshold, tail); FlashMemory+monitor (the same "
        "plus the miss monitor, escalation and fallback, at an equal average budget); Recency (newest pages); "
        "Random (tail + random pages); Oracle (golden labels of the coming window: reads the future); Reactive "
        "(latest step's native top-k, held for the window, HiSparse-like without lookahead).",
        "",
        *monitor_section(results),
        "## Stage times (s)",
        "",
        *[f"- {k}: {v:.1f}" for k, v in results["stage_seconds"].items()],
        "",
        "![coverage vs budget](coverage.png)",
        "",
    ]
    return "\n".join(lines)


def live_section(results: dict) -> list[str]:
    """Markdown lines, beside the replay table: the live sglang row (stage 7) and what it is; [] without --serve."""
    if "serving" not in results:
        return []
    from flashmemory.demo.serve_stage import live_note, live_table

    s = results["serving"]
    intro = (
        "Live serving (stage 7): real sglang servers on this CPU, P and D (FlashMemory on, shrink mode, Level 1 "
        "with a retriever) behind the PD router; chats from the test documents sent concurrently through the "
        "router with the `openai` client; counters from D's /metrics."
    )
    return [intro, "", live_table(s), "", *([live_note(s), ""] if live_note(s) else [])]


def plot_coverage(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    sweep = results["sweep"]
    names = list(next(iter(sweep.values())).keys()) if sweep else []
    for name in names:
        pts = sorted((v[name]["resident_frac"], v[name]["mass"]) for v in sweep.values())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.plot([1.0], [1.0], marker="*", markersize=12, linestyle="", label="Full")
    ax.set_xlabel("resident fraction of visible chunks")
    ax.set_ylabel("native top-k mass covered")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Coverage against resident budget")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def write_outputs(results: dict, out: Path, plot: bool = True, log=print) -> None:
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=str))
    atomic_write_text(out / "report.md", report_markdown(results))
    if plot:
        plot_coverage(results, out / "coverage.png")
    log("")
    log(method_table(results["methods"]))
    for line in unmatched_notes(results["methods"]):
        log(line)
    log("")
    for line in live_section(results):
        log(line)
    for line in task_tables(results.get("task_by_budget", {})):
        log(line)
    log("")
    log(f"wrote {out / 'report.md'}, {out / 'results.json'}" + (f", {out / 'coverage.png'}" if plot else ""))
