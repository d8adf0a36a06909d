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

SCOPE = ("Quality here is a mechanics check on a tiny random-weight model: it ranks residency policies at an "
         "equal page budget and catches regressions. It is not a LongBench/RULER accuracy claim.")


def _fmt(v, fmt: str, key: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v / 1024 if key == "recall_bytes" else v)


def method_table(methods: dict[str, dict]) -> str:
    """A GitHub-style markdown table, one row per method."""
    head = "| method | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|---|" + "|".join("---:" for _ in COLUMNS) + "|"
    rows = [f"| {name} | " + " | ".join(_fmt(m.get(k), f, k) for k, _, f in COLUMNS) + " |"
            for name, m in methods.items()]
    return "\n".join([head, sep, *rows])


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
        method_table(results["methods"]),
        "",
        "Columns: share of Full's native top-k softmax mass (every c4 layer, every decode step) inside the resident "
        "set; share of each step's golden labels resident; greedy next-token agreement with Full (teacher-forced); "
        "resident share of visible chunks; device KV bytes against Full at DeepSeek-V4 entry sizes (584-B c4 "
        "entries, index-K); bytes recalled host -> device by the offload engine; Level-1 time over Level-1 plus "
        "decode time; task score of the teacher-forced greedy tokens.",
        "",
        f"Scope: {SCOPE}",
        "",
        "Methods: Full (all resident); FlashMemory (trained retriever, threshold, tail); Recency (newest pages); "
        "Random (tail + random pages); Oracle (golden labels of the coming window: reads the future); Reactive "
        "(latest step's native top-k, held for the window, HiSparse-like without lookahead).",
        "",
        *(["## Live serving", "",
           "The retriever trained above, loaded by a real sglang decode server (FlashMemory on, shrink mode) behind "
           "the PD router, on CPU; chat requests from the test documents through the router with the `openai` "
           "client; counters read from the decode server's /metrics.", "",
           _live_table(results["serving"]), ""] if "serving" in results else []),
        "## Stage times (s)",
        "",
        *[f"- {k}: {v:.1f}" for k, v in results["stage_seconds"].items()],
        "",
        "![coverage vs budget](coverage.png)",
        "",
    ]
    return "\n".join(lines)


def _live_table(serving: dict) -> str:
    from flashmemory.demo.serve_stage import live_table
    return live_table(serving)


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
    log("")
    if "serving" in results:
        log(_live_table(results["serving"]))
        log("")
    log(f"wrote {out / 'report.md'}, {out / 'results.json'}" + (f", {out / 'coverage.png'}" if plot else ""))
