"""frontier.json, frontier.md and frontier.png from the finished documents of a frontier run.

Every rate carries n and a 95% interval over documents (`eval.harness.mean_rows` / `budget_cells`: Wilson for
task accuracy, the bootstrap for agreement and top-k mass). The iso-quality table picks, per task and overall, the
smallest budget whose FlashMemory accuracy (point estimate) reaches 0.95x and 0.99x of Full's, and sets its costs
beside HiSparse's at the same hot-buffer size and Full's. Costs are means over documents.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

RATIOS = (0.95, 0.99)
COST_KEYS = ("device_bytes", "h2d_per_token", "scored_per_token", "l1_flops_per_token")
PLOT_METHODS = (
    "Full",
    "HiSparse",
    "HiSparse+prefetch",
    "FlashMemory",
    "FlashMemory+monitor",
    "FlashMemory-fill",
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
    from flashmemory.eval.frontier_cost import project
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


def _nan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


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


def _fmt_bytes(v) -> str:
    if _nan(v):
        return "pending"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= div:
            return f"{v / div:.2f} {unit}"
    return f"{v:.0f} B"


def _ci(v, ci) -> str:
    if _nan(v):
        return "-"
    if not ci or _nan(ci.get("lo")):
        return f"{v:.3f}"
    return f"{v:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}]"


def markdown(res: dict, command: str) -> str:
    """frontier.md: the command, the budgets on both scales, the iso-quality table, accuracy / agreement / mass
    per budget, costs per budget, HiSparse's replayed hit rate and the DeepSeek-V4-Flash projection."""
    cfg, budgets = res["config"], sorted(res["methods"], key=float)
    k = res["index_topk"]
    per_task = ", ".join(f"{t} {n}" for t, n in res["docs_per_task"].items())
    L = [
        "# Quality against cost: FlashMemory, HiSparse and Full attention (`flashmemory eval frontier`)",
        "",
        f"Command: `{command}`",
        "",
        f"Model {Path(cfg['model']).name if cfg['model'] else 'dsv4-retrieval (the shipped trained tiny DeepSeek-V4)'}"
        f" (top-k {k}), retriever `{cfg['retriever']}`; documents of {cfg['doc_len']} prompt tokens (mean "
        f"{res['n_chunks_mean']:.0f} c4 chunks) + {cfg['gen_tokens']} decode steps; tau {cfg['tau']}, pages of "
        f"{cfg['page_chunks']} chunks, recency tail {cfg['tail_chunks']} chunks. Documents done: "
        f"{res['docs_done']} of {res['docs_planned']} planned ({per_task}); fingerprint `{res['fingerprint']}`. "
        f"Time per document (Full decode + every method at every budget, shared 2-core machine): "
        f"{res['doc_seconds_mean']:.1f} s.",
        "",
        "Intervals: 95% over documents (Wilson for task accuracy, bootstrap for the rest); n = documents.",
        "",
        "## Budgets",
        "",
        "| budget (share of history) | KMAX pages | resident chunks | resident / top-k |",
        "|---:|---:|---:|---:|",
    ]
    for b in budgets:
        fm = res["methods"][b]["FlashMemory"] if "FlashMemory" in res["methods"][b] else res["methods"][b]["Full"]
        L.append(
            f"| {float(b):.0%} | {fm.get('kmax', math.nan):.0f} | "
            f"{fm.get('resident_per_topk', math.nan) * k:.0f} | {fm.get('resident_per_topk', math.nan):.1f}x |"
        )
    L += [
        "",
        "## Iso-quality: the smallest budget where FlashMemory reaches 0.95x / 0.99x of Full",
        "",
        "| group | Full acc | target | budget | resident / top-k | FlashMemory acc [95%] | device bytes/req "
        "FM / HiSparse / Full | H2D bytes/token FM / HiSparse / HiSparse+prefetch | "
        "entries scored/token FM / HiSparse-Full | "
        "L1 FLOPs/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g, picks in res["iso"].items():
        for r, p in picks.items():
            if p["budget"] is None:
                why = p.get("note") or f"not reached (<= {float(budgets[-1]):.0%})"
                L.append(f"| {g} | {p['full_acc']:.3f} | {r}x | {why} | - | - | - | - | - | - |")
                continue
            c = p["costs"]
            fm, hs, fu = c.get("FlashMemory", {}), c.get("HiSparse", {}), c.get("Full", {})
            L.append(
                f"| {g} | {p['full_acc']:.3f} | {r}x | {float(p['budget']):.0%} | "
                f"{p['resident_per_topk']:.1f}x | {_ci(p['acc'], p['acc_ci'])} | "
                f"{_fmt_bytes(fm.get('device_bytes'))} / {_fmt_bytes(hs.get('device_bytes'))} / "
                f"{_fmt_bytes(fu.get('device_bytes'))} | {_fmt_bytes(fm.get('h2d_per_token'))} / "
                f"{_fmt_bytes(hs.get('h2d_per_token', math.nan))} / "
                f"{_fmt_bytes(c.get('HiSparse+prefetch', {}).get('h2d_per_token', math.nan))} | "
                f"{fm.get('scored_per_token', math.nan):.0f} / {fu.get('scored_per_token', math.nan):.0f} | "
                f"{fm.get('l1_flops_per_token', math.nan):.3g} |"
            )
    L += _verdict(res, budgets) + _accuracy_tables(res, budgets) + _cost_table(res, budgets)
    L += [
        "",
        "HiSparse's hit rate comes from `eval.hisparse_replay`, which reproduces the live "
        "`flashmemory_hisparse_swapin_*` counters exactly on recorded picks (tolerance zero; "
        "docs/hisparse-comparison.md, 'The hot buffer replayed on the live picks').",
    ]
    L += _projection_table(res, budgets)
    return "\n".join(L) + "\n"


def _verdict(res: dict, budgets: list[str]) -> list[str]:
    """Per budget, from the numbers above: FlashMemory's accuracy against Full's (HiSparse equals Full by
    construction) and the two methods' device bytes and H2D bytes side by side."""
    L = [
        "",
        "## FlashMemory or HiSparse, budget by budget",
        "",
        "HiSparse's outputs are Full's at every buffer size; what it pays is device bytes (index keys of the whole "
        "history plus its buffer), indexer work over the whole history, and synchronous host->device misses. "
        "FlashMemory pays in accuracy where its resident set misses what Full attends.",
        "",
        "| budget | FM acc / Full acc | FM device / HiSparse device | FM H2D / HiSparse H2D per token | "
        "FM entries scored / HiSparse |",
        "|---:|---:|---:|---:|---:|",
    ]
    for b in budgets:
        r = res["methods"][b]
        fm, hs, fu = r.get("FlashMemory", {}), r.get("HiSparse", {}), r.get("Full", {})
        ratio = fm.get("task_score", math.nan) / fu["task_score"] if fu.get("task_score") else math.nan

        def rel(key: str, fm: dict = fm, hs: dict = hs) -> str:
            a, c = fm.get(key, math.nan), hs.get(key, math.nan)
            return "-" if _nan(a) or _nan(c) or not c else f"{a / c:.2f}x"

        L.append(
            f"| {float(b):.0%} | {ratio:.2f} | {rel('device_bytes')} | "
            f"{_fmt_bytes(fm.get('h2d_per_token'))} / {_fmt_bytes(hs.get('h2d_per_token'))} | "
            f"{rel('scored_per_token')} |"
        )
    return L


def _accuracy_tables(res: dict, budgets: list[str]) -> list[str]:
    methods = list(res["methods"][budgets[0]])
    head = "| method | n | " + " | ".join(f"{float(b):.0%}" for b in budgets) + " |"
    sep = "|---|---:|" + "---:|" * len(budgets)
    L = ["", "## Task accuracy by budget (all tasks)", "", head, sep]
    for m in methods:
        n = res["methods"][budgets[0]][m].get("task_score_ci", {}).get("n", 0)
        L.append(
            f"| {m} | {n} | "
            + " | ".join(
                _ci(res["methods"][b][m].get("task_score"), res["methods"][b][m].get("task_score_ci")) for b in budgets
            )
            + " |"
        )
    for t in res["docs_per_task"]:
        L += ["", f"### {t} (n = {res['docs_per_task'][t]})", "", head, sep]
        for m in methods:
            L.append(
                f"| {m} | {res['docs_per_task'][t]} | "
                + " | ".join(
                    _ci(res["tasks"][b].get(f"task:{t}", {}).get(m), res["tasks"][b].get(f"task_ci:{t}", {}).get(m))
                    for b in budgets
                )
                + " |"
            )
    for key, title in (("agreement", "Agreement with Full's next token"), ("mass", "Top-k mass resident")):
        L += ["", f"## {title} by budget", "", head, sep]
        for m in methods:
            n = (res["methods"][budgets[0]][m].get(f"{key}_ci") or {}).get("n", 0)
            L.append(
                f"| {m} | {n} | "
                + " | ".join(_ci(res["methods"][b][m].get(key), res["methods"][b][m].get(f"{key}_ci")) for b in budgets)
                + " |"
            )
    return L


def _cost_table(res: dict, budgets: list[str]) -> list[str]:
    L = [
        "",
        "## Costs per method and budget (tiny model, replayed; means over documents)",
        "",
        "Device bytes/request = c4 KV (Full: all; FlashMemory-type: the KMAX reserve, the cap with the monitor; "
        "HiSparse: H + 1 hot slots per c4 layer) + index keys; H2D = recall (FlashMemory) or synchronous swap-in "
        "misses x 584 B (HiSparse) per decode step; entries scored = indexer entries per step over all c4 layers "
        "(+ Level 1's over tau).",
        "",
        "| budget | method | KMAX | mean pages kept | device bytes/req | c4 KV / buffer | index keys | H2D bytes/token "
        "| entries scored/token | L1 FLOPs/token | HiSparse hit rate |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in budgets:
        for m, r in res["methods"][b].items():
            hs = m.startswith("HiSparse")
            pend = hs and r.get("cost_pending", 0) > 0
            pages = r.get("mean_pages", math.nan)
            L.append(
                f"| {float(b):.0%} | {m} | {r.get('kmax', math.nan):.0f} | "
                f"{'-' if _nan(pages) else format(pages, '.1f')} | {_fmt_bytes(r.get('device_bytes'))} | "
                f"{_fmt_bytes(r.get('device_c4_kv'))} | {_fmt_bytes(r.get('device_index_keys'))} | "
                f"{'pending' if pend else _fmt_bytes(r.get('h2d_per_token'))} | "
                f"{r.get('scored_per_token', math.nan):.0f} | {r.get('l1_flops_per_token', math.nan):.3g} | "
                f"{'pending' if pend else format(r.get('hit_rate', math.nan), '.3f') if hs else '-'} |"
            )
    return L


def _projection_table(res: dict, budgets: list[str]) -> list[str]:
    L = [
        "",
        "## Projection to DeepSeek-V4-Flash on 8xH20 (cost model, not measured)",
        "",
        "Each budget's share of history held at 128K / 256K / 1M: FlashMemory at KMAX = share x chunks / 64 pages "
        "(Path-I at 1M), HiSparse with a hot buffer of the same KMAX x 64 slots at the hit rate replayed above "
        "(`flashmemory.costmodel`: `anchors.capacity`, `anchors.tok_s`, `bytes`, `hisparse`, `flops`).",
        "",
        "| budget | ctx | method | KMAX | resident / top-k | device bytes/req | H2D bytes/token | entries scored/token "
        "| L1 GFLOP/token | max conc (bound) | tok/s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in budgets:
        for r in res["projection"][b]:
            L.append(
                f"| {float(b):.0%} | {r['ctx'] // 1024}K | {r['method']} | {r['kmax']} | "
                f"{r['resident_per_topk']:.1f}x | {_fmt_bytes(r['device_bytes'])} | "
                f"{_fmt_bytes(r['h2d_per_token'])} | {r['scored_per_token']:.0f} | "
                f"{r['l1_flops_per_token'] / 1e9:.3f} | {r['conc']} ({r['bound']}) | {r['tok_s']:.0f} |"
            )
    return L


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
