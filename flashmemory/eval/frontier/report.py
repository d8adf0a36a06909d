"""frontier.json, frontier.md and frontier.png from the finished documents of a frontier run (frontier.md's text
is `markdown.markdown`).

Every rate carries n and a 95% interval over documents (`eval.harness.mean_rows` / `budget_cells`: Wilson for
task accuracy, the bootstrap for agreement and top-k mass). The iso-quality table picks, per task and overall, the
smallest budget whose FlashMemory accuracy (point estimate) reaches 0.95x and 0.99x of Full's, and sets its costs
beside HiSparse's at the same hot-buffer size and Full's. Costs are means over documents.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from flashmemory.eval.frontier.markdown import _nan, markdown

RATIOS = (0.95, 0.99)
COST_KEYS = ("device_bytes", "h2d_per_token", "scored_per_token", "l1_flops_per_token")
PLOT_METHODS = (
    "Full",
    "HiSparse",
    "HiSparse+prefetch",
    "FlashMemory",
    "FlashMemory+monitor",
    "FlashMemory-fill",
    "FlashMemory-threshold",
    "Oracle",
    "Recency",
)


def _flat(m: dict) -> dict:
    """A method row with its nested device parts flattened (mean_rows averages scalars and lists only)."""
    out = {k: v for k, v in m.items() if not isinstance(v, dict)}
    for k, v in (m.get("device_parts") or {}).items():
        out[f"device_{k.replace(' ', '_')}"] = v
    return out


def aggregate(recs: list[dict], config: dict, fp: str, planned: int) -> dict:
    """The results dict: per budget the method means with intervals ("methods"), per task cells ("tasks"), the
    iso-quality picks ("iso"), the DeepSeek-V4-Flash projection per budget ("projection") and run facts."""
    from flashmemory.eval.frontier.cost import project
    from flashmemory.eval.harness import budget_cells, mean_rows

    budgets = list(recs[0]["budgets"])
    tasks = [r["task"] for r in recs]
    by_budget, task_cells = {}, {}
    for b in budgets:
        rows = [{name: _flat(m) for name, m in r["budgets"][b].items()} for r in recs]
        by_budget[b] = mean_rows(rows)
        task_cells[b] = budget_cells(rows, tasks)
    hit = {b: by_budget[b]["HiSparse"].get("hit_rate") for b in budgets}
    projection = {b: project(float(b), None if _nan(hit[b]) else hit[b]) for b in budgets}
    n_task = {t: tasks.count(t) for t in dict.fromkeys(tasks)}
    res = {
        "format": "flashmemory-frontier-results/1",
        "config": config,
        "fingerprint": fp,
        "record_fingerprints": sorted({r["fingerprint"] for r in recs} - {fp}),  # legacy records' own
        "recosted": sum(bool(r.get("recosted")) for r in recs),  # records whose costs `--recost` recomputed
        "docs_done": len(recs),
        "docs_planned": planned,
        "docs_per_task": n_task,
        "doc_seconds_mean": sum(r["seconds"] for r in recs) / len(recs),
        "n_chunks_mean": sum(r["n_chunks"] for r in recs) / len(recs),
        "index_topk": recs[0]["index_topk"],
        "methods": by_budget,
        "tasks": task_cells,
        "projection": projection,
    }
    res["iso"] = iso_quality(res, ["overall"] + list(n_task))
    return res


def _acc(res: dict, b: str, group: str, method: str) -> tuple[float, dict | None]:
    if group == "overall":
        m = res["methods"][b].get(method, {})
        return m.get("task_score", math.nan), m.get("task_score_ci")
    cell = res["tasks"][b]
    return (cell.get(f"task:{group}", {}).get(method, math.nan), cell.get(f"task_ci:{group}", {}).get(method))


def iso_quality(res: dict, groups: list[str], method: str = "FlashMemory") -> dict:
    """{group: {"0.95": pick, "0.99": pick}}: pick = the smallest budget (ascending share) where `method`'s task
    accuracy >= ratio x Full's, with its accuracy, interval and the costs of `method`, HiSparse and Full there;
    {"budget": None, ...} when no budget of the sweep reaches it."""
    budgets = sorted(res["methods"], key=float)
    out: dict = {}
    for g in groups:
        full = _acc(res, budgets[0], g, "Full")[0]
        out[g] = {}
        for r in RATIOS:
            pick: dict = {"budget": None, "full_acc": full, "ratio": r}
            if _nan(full) or full <= 0:  # Full solves none of them: no fraction of it to reach
                out[g][f"{r:g}"] = pick | {"note": "Full scores 0"}
                continue
            for b in budgets:
                acc, ci = _acc(res, b, g, method)
                if not _nan(acc) and not _nan(full) and acc >= r * full - 1e-12:
                    rows = res["methods"][b]
                    pick |= {
                        "budget": b,
                        "acc": acc,
                        "acc_ci": ci,
                        "resident_per_topk": rows[method].get("resident_per_topk"),
                        "costs": {
                            name: {k: rows[name].get(k) for k in COST_KEYS + ("hit_rate",)}
                            for name in (method, "HiSparse", "HiSparse+prefetch", "Full")
                            if name in rows
                        },
                    }
                    break
            out[g][f"{r:g}"] = pick
    return out


def plot(res: dict, path: Path) -> None:
    """frontier.png: task accuracy against device bytes per request and against H2D bytes per token, one line
    per method over the budgets (Full is one point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted(res["methods"], key=float)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in (
        (axes[0], "device_bytes", "device bytes per request"),
        (axes[1], "h2d_per_token", "host->device bytes per token"),
    ):
        for m in PLOT_METHODS:
            pts = [
                (res["methods"][b][m].get(key), res["methods"][b][m].get("task_score"))
                for b in budgets
                if m in res["methods"][b]
            ]
            pts = [(x, y) for x, y in pts if not _nan(x) and not _nan(y)]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=m)
        ax.set_xscale("symlog" if key == "h2d_per_token" else "log")
        ax.set_xlabel(label)
        ax.set_ylabel("task accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"Quality vs cost, {res['docs_done']} documents, budgets " + ", ".join(f"{float(b):.0%}" for b in budgets)
    )
    fig.tight_layout()
    from flashmemory.atomic import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_outputs(
    recs: list[dict],
    fc,
    fp: str,
    planned: int,
    out: Path,
    log=print,
    extra: list[str] | None = None,
    compare: str | None = None,
) -> dict:
    """Aggregate and write frontier.json, frontier.md (with `extra` markdown lines appended) and frontier.png
    (atomically) into `out`. compare: the --compare dir named in the command line."""
    from dataclasses import asdict

    from flashmemory.atomic import atomic_write_text

    res = aggregate(recs, asdict(fc), fp, planned)
    atomic_write_text(out / "frontier.json", json.dumps(res, indent=1, default=float))
    cmd = command_line(fc) + (f" --compare {compare}" if compare else "")
    atomic_write_text(out / "frontier.md", markdown(res, cmd) + "\n".join(extra or []) + ("\n" if extra else ""))
    plot(res, out / "frontier.png")
    log(f"[frontier] {len(recs)} of {planned} documents -> {out}/frontier.md, frontier.json, frontier.png")
    return res


def command_line(fc) -> str:
    """The `flashmemory eval frontier` command that reproduces this configuration."""
    d = type(fc)(out_dir=fc.out_dir, retriever=fc.retriever)  # the defaults, to name only the flags that differ
    parts = ["flashmemory eval frontier", f"--out {fc.out_dir}", f"--retriever {fc.retriever}"]
    for name in (
        "n_per_task",
        "budgets",
        "methods",
        "tasks",
        "model",
        "doc_len",
        "gen_tokens",
        "tau",
        "page_chunks",
        "tail_chunks",
        "threshold",
        "first_doc",
        "seed",
    ):
        v = getattr(fc, name)
        if v != getattr(d, name):
            parts.append(
                f"--{name.replace('_', '-')} {','.join(f'{x:g}' if isinstance(x, float) else x for x in v)}"
                if isinstance(v, tuple)
                else f"--{name.replace('_', '-')} {v}"
            )
    return " ".join(parts)
