"""A frontier run's methods beside another run's on the documents both finished (`eval frontier --compare DIR`).

Used to show what a variant of FlashMemory run separately (e.g. `--methods FlashMemory-fill`) does against the
main run's FlashMemory, budget by budget, on the same documents: both runs must have produced the same document
under each index (same prompt length and Full's task score), else the comparison is refused naming the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from flashmemory.errors import UserError

SHOW = ("task_score", "agreement", "mass", "mean_pages", "device_bytes", "h2d_per_token")


def load_records(out_dir: str, fmt: str) -> dict[int, dict]:
    """{document index: record} of every finished document under out_dir/docs (any configuration)."""
    out = {}
    for p in sorted((Path(out_dir) / "docs").glob("*.json")):
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if p.stem.isdigit() and isinstance(rec, dict) and rec.get("format") == fmt:
            out[int(p.stem)] = rec
    return out


def compare_lines(recs: list[dict], other_dir: str, fmt: str, base: str = "FlashMemory") -> list[str]:
    """Markdown: per budget, `base` and Full of this run beside the methods only `other_dir` ran, each with its
    task accuracy (Wilson 95%), agreement, top-k mass, mean resident pages, device and H2D bytes, over the
    documents both runs finished (n stated)."""
    from flashmemory.eval.frontier_markdown import _ci, _fmt_bytes
    from flashmemory.eval.frontier_report import _flat
    from flashmemory.eval.harness import mean_rows

    other = load_records(other_dir, fmt)
    if not Path(other_dir).is_dir():
        raise UserError(f"--compare {other_dir}: not a directory")
    common = [r for r in recs if r["index"] in other]
    head = ["", f"## {base} beside the methods of `{other_dir}` (same documents)", ""]
    if not common:
        return head + [f"No finished document of {other_dir} is among this run's ({len(recs)} finished)."]
    for r in common:
        o = other[r["index"]]
        b0 = next(iter(r["budgets"]))
        same = (
            o.get("prompt_len") == r.get("prompt_len")
            and b0 in o["budgets"]
            and o["budgets"][b0]["Full"].get("task_score") == r["budgets"][b0]["Full"].get("task_score")
        )
        if not same:
            raise UserError(
                f"--compare {other_dir}: document {r['index']} differs from this run's (another "
                "document length, seed or model)"
            )
    b0 = next(iter(common[0]["budgets"]))
    extra = [m for m in other[common[0]["index"]]["budgets"][b0] if m not in common[0]["budgets"][b0]]
    L = head + [
        f"{len(common)} documents in both runs; {', '.join(extra) or 'no method'} from {other_dir}.",
        "",
        "| budget | method | n | task acc [95%] | agreement | top-k mass | mean pages | device bytes/req | "
        "H2D bytes/token |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in common[0]["budgets"]:
        rows = []
        for r in common:
            o = other[r["index"]]["budgets"].get(b, {})
            row = {m: _flat(r["budgets"][b][m]) for m in ("Full", base) if m in r["budgets"][b]}
            rows.append(row | {m: _flat(o[m]) for m in extra if m in o})
        if any(set(x) != set(rows[0]) for x in rows):
            continue
        for m, v in mean_rows(rows).items():
            L.append(
                f"| {float(b):.0%} | {m} | {len(rows)} | {_ci(v.get('task_score'), v.get('task_score_ci'))} | "
                f"{v.get('agreement', math.nan):.3f} | {v.get('mass', math.nan):.3f} | "
                f"{v.get('mean_pages', math.nan):.1f} | {_fmt_bytes(v.get('device_bytes'))} | "
                f"{_fmt_bytes(v.get('h2d_per_token'))} |"
            )
    return L
