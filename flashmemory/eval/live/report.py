"""live.json and live.md: the live arms beside the replay's rows for the same documents and settings.

Per arm: task accuracy with a 95% Wilson interval over documents, the replay's accuracy on the same documents with
its interval and whether the two intervals overlap; per-document agreement (the same task score live and in the
replay); documents whose 24 tokens equal live stock's, and equal the replay's; D's counted costs per document
(/metrics deltas: recall bytes, HiSparse swap-in misses and bytes, prefetch bytes; the resident fraction gauge as
sampled while the document decoded, `gauges_live`: read after it, with no request live, it says 0).
Then every document where live and replay differ (task score or tokens), with the first differing token and the
tokens on both sides at that position.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashmemory.eval.live.replay import finite, first_difference

COSTS = {  # name in the report -> D's /metrics sample (counters as deltas per document)
    "recall_bytes": "flashmemory_recall_bytes_total",
    "recall_pages": "flashmemory_recall_pages_total",
    "resident_fraction": "flashmemory_resident_fraction",
    "level1_cycles": "flashmemory_level1_cycles_total",
    "swapin_misses": "flashmemory_hisparse_swapin_misses_total",
    "swapin_bytes": "flashmemory_hisparse_swapin_bytes_h2d_total",
    "swapin_lookups": "flashmemory_hisparse_swapin_lookups_total",
    "prefetch_bytes": "flashmemory_hisparse_prefetch_bytes_h2d_total",
}


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if finite(x)]
    return sum(xs) / len(xs) if xs else None


def _sample(rec: dict, name: str) -> float:
    """A record's value of D's series `name`: a counter's delta over the document, a gauge's mean while it decoded
    (records without live samples: NaN, so an idle gauge read after the document never counts)."""
    if name.endswith("_total"):
        return rec.get("metrics", {}).get(name, float("nan"))
    return (rec.get("gauges_live") or {}).get(name, float("nan"))


def _acc(scores: list[float]) -> dict:
    from flashmemory.eval.intervals import interval

    cell = interval(scores, "wilson") if scores else {"n": 0, "lo": None, "hi": None, "method": "wilson"}
    return {"mean": _mean(scores), **cell}


def arm_summary(arm: str, recs: dict[int, dict], stock: dict[int, dict], replay: dict[int, dict], rtoks: dict) -> dict:
    """One arm's cells (see the module doc). rtoks: {document index: replay token lists by arm key}."""
    idx = sorted(recs)
    both = [i for i in idx if i in replay]
    live_acc = _acc([recs[i]["task_score"] for i in idx])
    live_same = _acc([recs[i]["task_score"] for i in both])
    rep_same = _acc([float(replay[i]["task_score"]) for i in both])
    overlap = None
    if both and live_same["lo"] is not None and rep_same["lo"] is not None:
        overlap = live_same["lo"] <= rep_same["hi"] and rep_same["lo"] <= live_same["hi"]
    agree = [i for i in both if abs(recs[i]["task_score"] - float(replay[i]["task_score"])) < 1e-9]
    vs_stock = [i for i in idx if i in stock]
    eq_stock = [i for i in vs_stock if recs[i]["output_ids"] == stock[i]["output_ids"]]
    ref = "Full" if arm == "stock" or arm.startswith("HiSparse") else arm
    with_tok = [i for i in idx if ref in rtoks.get(i, {})]
    eq_replay = [i for i in with_tok if recs[i]["output_ids"] == rtoks[i][ref]]
    gen = max(1, len(recs[idx[0]]["output_ids"])) if idx else 1
    costs = {k: _mean([_sample(recs[i], m) for i in idx]) for k, m in COSTS.items()}
    per_token = {
        f"{k}_per_token": (v / gen if v is not None else None) for k, v in costs.items() if k.endswith("bytes")
    }
    diffs = []
    for i in idx:
        rs = replay.get(i, {}).get("task_score")
        rt = rtoks.get(i, {}).get(ref)
        score_differs = rs is not None and abs(recs[i]["task_score"] - float(rs)) >= 1e-9
        tok_pos = first_difference(recs[i]["output_ids"], rt) if rt is not None else None
        if not score_differs and tok_pos is None:
            continue
        diffs.append(
            {
                "index": i,
                "task": recs[i]["task"],
                "live_score": recs[i]["task_score"],
                "replay_score": rs,
                "first_diff_vs_replay": tok_pos,
                "live_token": recs[i]["output_ids"][tok_pos] if tok_pos is not None and tok_pos < gen else None,
                "replay_token": rt[tok_pos] if rt is not None and tok_pos is not None and tok_pos < len(rt) else None,
                "first_diff_vs_stock": first_difference(recs[i]["output_ids"], stock[i]["output_ids"])
                if i in stock
                else None,
                "live_text": recs[i].get("text", ""),
                "replay_tokens": rt is not None,
            }
        )
    return {
        "docs": len(idx),
        "accuracy": live_acc,
        "same_docs": len(both),
        "accuracy_same_docs": live_same,
        "replay_accuracy": rep_same,
        "intervals_overlap": overlap,
        "agree_with_replay": len(agree),
        "tokens_equal_stock": len(eq_stock),
        "docs_with_stock": len(vs_stock),
        "tokens_equal_replay": len(eq_replay),
        "docs_with_replay_tokens": len(with_tok),
        "prompt_ids_equal": sum(bool(recs[i].get("prompt_ids_equal")) for i in idx),
        "seconds_mean": _mean([recs[i]["seconds"] for i in idx]),
        "costs": costs | per_token,
        "settings": recs[idx[0]]["settings"] if idx else {},
        "differences": diffs,
    }


def aggregate(cfg, done: dict[str, dict[int, dict]], replay: dict[str, dict[int, dict]], rtoks: dict) -> dict:
    """live.json's content: the run's settings, per arm `arm_summary`, per task accuracy per arm."""
    stock = done.get("stock", {})
    arms = {}
    for a in cfg.arms:
        arms[a.key] = arm_summary(a.key, done.get(a.key, {}), stock, replay.get(a.key, {}), rtoks)
    tasks: dict[str, dict[str, dict]] = {}
    for a in cfg.arms:
        for t in cfg.tasks:
            recs = [r for r in done.get(a.key, {}).values() if r["task"] == t]
            rep = [
                float(replay.get(a.key, {})[r["index"]]["task_score"])
                for r in recs
                if r["index"] in replay.get(a.key, {})
            ]
            tasks.setdefault(t, {})[a.key] = {"live": _acc([r["task_score"] for r in recs]), "replay": _acc(rep)}
    return {
        "format": "flashmemory-live-results/1",
        "planned_per_arm": cfg.n_per_task * len(cfg.tasks),
        "arms": arms,
        "tasks": tasks,
        "iso": {a.kind: iso_budgets(tasks, cfg.arms, a.kind) for a in cfg.arms if a.budget is not None},
        "budgets": sorted({a.budget for a in cfg.arms if a.budget is not None}),
    }


RATIOS = (0.95, 0.99)


def _mean_of(cells: dict[str, dict], arm: str, side: str) -> float | None:
    return ((cells.get(arm) or {}).get(side) or {}).get("mean")


def iso_budgets(tasks: dict[str, dict[str, dict]], arms, kind: str) -> dict[str, dict[str, dict]]:
    """{task: {"0.95": {"live": budget | None, "replay": budget | None}, ...}}: the smallest budget of the run
    where `kind`'s task accuracy reaches ratio x stock's, live against live stock and replay against the replay's
    Full on the same documents (the frontier's iso-quality rule, point estimates). None: no budget of the run
    reaches it (or stock scores 0 there: no fraction of it to reach)."""
    keys = {a.budget: a.key for a in arms if a.kind == kind and a.budget is not None}
    out: dict[str, dict[str, dict]] = {}
    for t, cells in tasks.items():
        out[t] = {}
        for r in RATIOS:
            pick: dict = {}
            for side in ("live", "replay"):
                base = _mean_of(cells, "stock", side)
                reached = [
                    b for b in sorted(keys) if base and (_mean_of(cells, keys[b], side) or 0) >= r * base - 1e-12
                ]
                pick[side] = reached[0] if reached else None
            out[t][f"{r:g}"] = pick
    return out


def _f(v, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _ci(c: dict) -> str:
    if not c or c.get("mean") is None:
        return "-"
    return f"{c['mean']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}] (n {c['n']})"


def _kib(v) -> str:
    return "-" if v is None else f"{v / 1024:.2f} KiB"


def markdown(res: dict, command: str, notes: list[str], words) -> str:
    """live.md from `aggregate`'s dict; words(ids) -> text of token ids (the task tokenizer's)."""
    L = [
        "# Live quality: the task suite through sglang's PD stack (`flashmemory eval live`)",
        "",
        f"Command: `{command}`",
        "",
        "Each arm is its own P + D + router stack on 127.0.0.1 (`flashmemory serve`'s), asked through the router "
        "with the OpenAI client (`/v1/completions`, a text prompt from the task tokenizer, greedy, ignore_eos); "
        "answers decoded with the task tokenizer and scored with the task scorer. Replay: the replay frontier's "
        "row of the same method and budget for the same documents (stock against Full). Intervals: 95% Wilson "
        "over documents.",
        "",
    ]
    L += [f"- {n}" for n in notes] + ([""] if notes else [])
    L += [
        "| arm | docs | live accuracy | replay accuracy (same docs) | live, same docs | overlap | same score as "
        "replay | tokens = stock | tokens = replay | prompt ids equal | s / doc |",
        "|---|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|",
    ]
    for k, a in res["arms"].items():
        ov = {None: "-", True: "yes", False: "**no**"}[a["intervals_overlap"]]
        L.append(
            f"| {k} | {a['docs']} | {_ci(a['accuracy'])} | {_ci(a['replay_accuracy'])} | "
            f"{_ci(a['accuracy_same_docs'])} | {ov} | {a['agree_with_replay']}/{a['same_docs']} | "
            f"{a['tokens_equal_stock']}/{a['docs_with_stock']} | {a['tokens_equal_replay']}/"
            f"{a['docs_with_replay_tokens']} | {a['prompt_ids_equal']}/{a['docs']} | {_f(a['seconds_mean'], 0)} |"
        )
    L += ["", "## Accuracy per task (live / replay, same documents)", ""]
    arms = list(res["arms"])
    L += ["| task | " + " | ".join(arms) + " |", "|---|" + "---:|" * len(arms)]
    for t, cells in res["tasks"].items():
        L.append(
            f"| {t} | "
            + " | ".join(f"{_f(cells[a]['live']['mean'])} / {_f(cells[a]['replay']['mean'])}" for a in arms)
            + " |"
        )
    for kind, per_task in res.get("iso", {}).items():
        top = max(res.get("budgets") or [0])
        L += [
            "",
            f"## Iso-quality: the smallest budget where {kind} reaches 0.95x / 0.99x of stock (live / replay)",
            "",
        ]
        L += ["| task | 0.95x | 0.99x |", "|---|---:|---:|"]
        cell = lambda b: "-" if b is None else f"{b:.0%}"  # noqa: E731
        for t, picks in per_task.items():
            L.append(
                f"| {t} | " + " | ".join(f"{cell(p['live'])} / {cell(p['replay'])}" for p in picks.values()) + " |"
            )
        L += ["", f"- '-': not reached at the budgets run (up to {top:.0%}), or stock scores 0 on the task."]
    L += [
        "",
        "## Counted costs (D's /metrics, mean per document)",
        "",
        "| arm | settings | recall bytes / token | resident fraction | Level-1 cycles | HiSparse swap-in misses | "
        "swap-in bytes / token | prefetch bytes / token |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, a in res["arms"].items():
        c, s = a["costs"], a["settings"]
        what = ", ".join(
            f"{n} {s[n]}" for n in ("kmax_pages", "resident_chunks", "hot_slots", "top_k", "c4_mode") if n in s
        )
        L.append(
            f"| {k} | {what or '-'} | {_kib(c.get('recall_bytes_per_token'))} | {_f(c.get('resident_fraction'))} | "
            f"{_f(c.get('level1_cycles'), 1)} | {_f(c.get('swapin_misses'), 0)} | "
            f"{_kib(c.get('swapin_bytes_per_token'))} | "
            f"{_kib(c.get('prefetch_bytes_per_token'))} |"
        )
    L += ["", "## Where live and replay differ", ""]
    any_diff = False
    for k, a in res["arms"].items():
        for d in a["differences"]:
            any_diff = True
            pos = d["first_diff_vs_replay"]
            at = (
                f"first differing token at {pos} (live {d['live_token']} {words([d['live_token']])!r}, replay "
                f"{d['replay_token']} {words([d['replay_token']])!r})"
                if pos is not None and d["live_token"] is not None and d["replay_token"] is not None
                else "tokens equal to the replay's"
                if pos is None and d["replay_tokens"]
                else "replay tokens not computed (--replay-tokens)"
            )
            st = d["first_diff_vs_stock"]
            L.append(
                f"- {k}, document {d['index']} ({d['task']}): score live {_f(d['live_score'])}, replay "
                f"{_f(d['replay_score'])}; {at}; vs live stock: "
                f"{'equal' if st is None else f'differs from token {st}'}; "
                f"live answer {d['live_text'][:80]!r}"
            )
    if not any_diff:
        L.append("None among the documents done.")
    return "\n".join(L) + "\n"


def command_line(cfg) -> str:
    """The `flashmemory eval live` command of this configuration (the flags that differ from the defaults)."""
    kinds = ",".join(dict.fromkeys(a.kind for a in cfg.arms))
    parts = [f"flashmemory eval live --out {cfg.out_dir} --model {cfg.model} --arms {kinds}"]
    parts.append(f"--budgets {','.join(f'{b:g}' for b in cfg.budgets)}")
    if cfg.retriever:
        parts.append(f"--retriever {cfg.retriever}")
    parts.append(f"--n-per-task {cfg.n_per_task}")
    for k, v in cfg.server_env:
        parts.append(f"--server-env {k}={v}")
    if cfg.replay:
        parts.append(f"--replay {cfg.replay}")
    return " ".join(parts)


def write_report(cfg, out: Path, done: dict[str, dict[int, dict]], log=print) -> dict:
    """Aggregate and write live.json and live.md (atomically) into `out`."""
    from flashmemory.atomic import atomic_write_text
    from flashmemory.eval.live.replay import (
        DOC_KEYS,
        REPLAY_KEYS,
        ReplayTokens,
        replay_config,
        replay_rows,
        setting_differences,
        topk_notes,
    )
    from flashmemory.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer)
    indices = sorted({i for recs in done.values() for i in recs})
    live_settings = {k: getattr(cfg, k) for k in REPLAY_KEYS}
    differ = setting_differences(live_settings, replay_config(cfg.replay))
    notes = [f"Setting differs from the replay's: {d}" for d in differ]
    same_docs = not any(d.split(":")[0] in DOC_KEYS for d in differ)
    if cfg.replay and not same_docs:
        notes.append("The replay's documents are not these (a document setting differs): no replay column")
    replay = replay_rows(cfg.replay, cfg.arms, indices) if same_docs else {}
    notes += topk_notes(cfg.replay, done)
    rtoks: dict[int, dict] = {}
    if cfg.replay_tokens and cfg.replay and cfg.replay_retriever and same_docs:
        rt = ReplayTokens(out, cfg.replay_retriever, cfg.budgets, cfg, log)
        docs = {i: r for recs in done.values() for i, r in recs.items()}
        for i in indices:
            rtoks[i] = rt.tokens(i, docs[i]["task"], docs[i]["doc"])
        notes += rt.check(replay)
    res = aggregate(cfg, done, replay, rtoks)
    res["replay"] = cfg.replay
    atomic_write_text(out / "live.json", json.dumps(res, indent=1, default=float))

    def words(ids):
        return " ".join(tok.decode([i]) if 0 <= i < tok.vocab_size else "<special>" for i in ids if i is not None)

    atomic_write_text(out / "live.md", markdown(res, command_line(cfg), notes, words))
    log(f"[live] report -> {out}/live.md, live.json")
    return res
