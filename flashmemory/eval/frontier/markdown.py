"""frontier.md, the report a frontier run writes beside frontier.json: the command, the budgets on both scales,
the iso-quality table with its verdict, accuracy / agreement / top-k mass per budget with 95% intervals, costs per
budget, HiSparse's replayed hit rate and the DeepSeek-V4-Flash projection. Everything is read from the results
dict of `report.aggregate`; a missing value prints as "-" or "pending", never as a number.
"""

from __future__ import annotations

import math
from pathlib import Path


def _nan(v) -> bool:
    """True for a missing value: None or a float NaN."""
    return v is None or (isinstance(v, float) and math.isnan(v))


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
        f"{res['docs_done']} of {res['docs_planned']} planned ({per_task}); fingerprint `{res['fingerprint']}`"
        + "".join(f" (records of the older fingerprint scheme: `{f}`)" for f in res.get("record_fingerprints", []))
        + (
            f"; HiSparse costs recomputed from the stored per-arm stats (`--recost`) in {res['recosted']} of "
            f"{res['docs_done']} records"
            if res.get("recosted")
            else ""
        )
        + ". "
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
