"""`flashmemory eval quality` outputs: results.json and report.md from the finished documents' records.

Every rate carries n and a 95% interval (`eval.harness.mean_rows` / `budget_cells`, which use `eval.intervals`);
the tables are the demo's (`flashmemory.demo.report`), so the two read alike. The monitor section compares
FlashMemory, FlashMemory+monitor and Oracle per task and budget, with the monitor's readings (miss mass
quantiles, escalations, fallbacks) and whether the equal-budget search matched.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MONITOR_METHODS = ("FlashMemory", "FlashMemory+monitor", "Oracle")


def aggregate(recs: list[dict], config: dict, model_note: str, planned: int) -> dict:
    """The results dict of finished document records (each {"index", "task", "seconds", "budgets": {budget:
    {method: metrics}}}), in plan order. planned: documents the run plans (the report says when fewer are done)."""
    from flashmemory.eval.harness import budget_cells, mean_rows

    budgets = list(recs[0]["budgets"])
    tasks = [r["task"] for r in recs]
    by_budget, task_by_budget, monitor = {}, {}, {}
    for b in budgets:
        rows = [r["budgets"][b] for r in recs]
        by_budget[b] = mean_rows(rows)
        task_by_budget[b] = budget_cells(rows, tasks)
        if "FlashMemory+monitor" in rows[0]:
            monitor[b] = {}
            for task in dict.fromkeys(tasks):
                sel = [{k: d[k] for k in MONITOR_METHODS if k in d} for t, d in zip(tasks, rows) if t == task]
                monitor[b][task] = mean_rows(sel)
    per_doc = {
        str(r["index"]): {
            "task": r["task"],
            "seconds": r["seconds"],
            **{
                b: {m: {k: v.get(k) for k in ("task_score", "mass", "mean_pages")} for m, v in r["budgets"][b].items()}
                for b in budgets
            },
        }
        for r in recs
    }
    n_task = {t: tasks.count(t) for t in dict.fromkeys(tasks)}
    return {
        "config": config,
        "model_note": model_note,
        "docs_done": len(recs),
        "docs_planned": planned,
        "docs_per_task": n_task,
        "doc_seconds_total": sum(r["seconds"] for r in recs),
        "methods_by_budget": by_budget,
        "task_by_budget": task_by_budget,
        "monitor_by_budget": monitor,
        "per_doc": per_doc,
    }


def _q(values: list[float]) -> str:
    from flashmemory.demo.report import quantiles

    q = quantiles(values)
    return f"p10/p50/p90 {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} over {len(values)} readings"


def monitor_lines(results: dict) -> list[str]:
    """The monitor's case: FlashMemory vs FlashMemory+monitor vs Oracle per task and budget, with intervals."""
    from flashmemory.demo.report import budget_cell, interval_cell, row_n

    mon = results.get("monitor_by_budget") or {}
    if not mon:
        return []
    lines = [
        "## The monitor's case: FlashMemory vs FlashMemory+monitor vs Oracle",
        "",
        "| budget | task | method | n | task score | top-k mass | mean pages | KMAX / base / cap | miss mass | "
        "escalations / doc | fallbacks / doc | equal budget |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for b, per_task in mon.items():
        for task, methods in per_task.items():
            for name in MONITOR_METHODS:
                m = methods.get(name)
                if m is None:
                    continue
                n = row_n(m)
                esc = "-" if name != "FlashMemory+monitor" else f"{m.get('escalations', math.nan):.2f}"
                fb = "-" if name != "FlashMemory+monitor" else f"{m.get('fallbacks', math.nan):.2f}"
                caps = (
                    f"{m.get('kmax', math.nan):.2f} / {m.get('base_pages', math.nan):.2f} / "
                    f"{m.get('cap_pages', math.nan):.2f}"
                    if name == "FlashMemory+monitor"
                    else f"{m.get('kmax', math.nan):.2f}"
                )
                lines.append(
                    f"| {float(b):.0%} | {task} | {name} | {'-' if n is None else n} | "
                    f"{interval_cell(m.get('task_score'), m.get('task_score_ci'), '{:.3f}', n)} | "
                    f"{interval_cell(m.get('mass'), m.get('mass_ci'), '{:.3f}', n)} | "
                    f"{m.get('mean_pages', 0):.2f} | {caps} | "
                    f"{interval_cell(m.get('miss_mass_mean'), m.get('miss_mass_mean_ci'), '{:.3f}', n)} | "
                    f"{esc} | {fb} | {budget_cell(m)} |"
                )
    lines.append("")
    for b, methods in (results.get("methods_by_budget") or {}).items():
        m = methods.get("FlashMemory+monitor")
        if m:
            lines.append(
                f"- at {float(b):.0%}: monitor miss mass {_q(m.get('miss_values', []))}; "
                f"{m.get('escalations', 0) * row_n(m):.0f} escalations and "
                f"{m.get('fallbacks', 0) * row_n(m):.0f} fallbacks over {row_n(m)} documents"
            )
    return lines + [
        "",
        "KMAX / base / cap: mean pages per document. FlashMemory+monitor runs at the largest base "
        "budget (and cap) whose mean resident pages stay within FlashMemory's; where the cap equals KMAX, "
        "the monitor cannot widen the budget and the pages it injects replace retriever picks. The miss "
        "mass of a reading is 1 - the rotated layer's native top-k mass over the set the previous decode "
        "step attended; the first cycle (before any decode step) takes no reading.",
        "",
    ]


def command(qc: dict) -> str:
    """The `flashmemory eval quality` command line of a run's QualityConfig (as a dict)."""
    parts = [
        "flashmemory eval quality",
        f"--out-dir {qc['out_dir']}",
        f"--n-per-task {qc['n_per_task']}",
        f"--budgets {','.join(str(b) for b in qc['budgets'])}",
    ]
    parts += [
        f"--{k.replace('_', '-')} {','.join(v) if isinstance(v, (list, tuple)) else v}"
        for k, v in qc.items()
        if k in ("methods", "tasks", "tau", "seed", "retriever") and v
    ]
    return " ".join(parts)


def report_markdown(results: dict) -> str:
    """The run's report.md."""
    from flashmemory.demo.report import INTERVAL_NOTE, method_table, scope, task_tables, unmatched_notes

    c = results["config"]
    qc = c["quality"]
    done, planned = results["docs_done"], results["docs_planned"]
    per = ", ".join(f"{t} {n}" for t, n in results["docs_per_task"].items())
    status = (
        f"**{done} of {planned} planned documents are done** (the same command continues the run)."
        if done < planned
        else f"All {planned} planned documents are done."
    )
    lines = [
        "# FlashMemory quality run (`flashmemory eval quality`)",
        "",
        f"Model `{Path(c['model']).name}`; held-out documents ({per}) of {c['doc_len']} prompt tokens + "
        f"{c['gen_tokens']} decode steps; the demo's retriever ({c['n_train']} train / {c['n_val']} val "
        f"documents) on c4 layers {tuple(c['target_layers'])}; tau = {c['tau']} steps; pages of "
        f"{c['page_chunks']} chunks; recency tail {c['tail_chunks']} chunks; every method gets the same KMAX "
        "pages (FlashMemory may keep fewer: threshold; FlashMemory+monitor runs at FlashMemory's measured mean "
        "pages).",
        "",
        results.get("model_note", ""),
        "",
        status + f" Fingerprint `{c['fingerprint']}`.",
        "",
        f"Document time: {results['doc_seconds_total']:.0f} s in all, "
        f"{results['doc_seconds_total'] / max(done, 1):.1f} s per document (Full decode + every method at every "
        "budget), measured on the shared 2-core machine.",
        "",
        "## Task accuracy by page budget",
        "",
        *task_tables(results["task_by_budget"]),
        "",
        INTERVAL_NOTE,
        "",
    ]
    for b, methods in results["methods_by_budget"].items():
        lines += [
            f"## Every metric at {float(b):.0%} of pages",
            "",
            method_table(methods),
            "",
            *unmatched_notes(methods, f" at {float(b):.0%}"),
            "",
        ]
    lines += monitor_lines(results)
    lines += [
        f"Scope: {scope(results)}",
        "",
        f"Reproduce: `{command(qc)}` (resumable: rerun it to continue; per-document records in {qc['out_dir']}/docs/).",
    ]
    return "\n".join(lines) + "\n"


def write_results(results: dict, out: Path, log=print) -> None:
    """Atomically write out/results.json and out/report.md; print the task-accuracy table."""
    from flashmemory.atomic import atomic_write_text
    from flashmemory.demo.report import task_tables

    atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=str))
    atomic_write_text(out / "report.md", report_markdown(results))
    log("\n".join(task_tables(results["task_by_budget"])))
    log(
        f"[quality] {results['docs_done']} of {results['docs_planned']} documents; wrote {out / 'results.json'} "
        f"and {out / 'report.md'}"
    )
