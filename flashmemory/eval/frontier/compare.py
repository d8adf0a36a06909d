"""A frontier run's methods beside another run's on the documents both finished (`eval frontier --compare DIR`).

Used to show what a variant of FlashMemory run separately (e.g. `--methods FlashMemory-fill`) does against the
main run's FlashMemory, budget by budget, on the same documents. DIR must be a frontier run's output (its kind
marker or records), and every setting that changes a document's decode must agree (all but --methods and
--first-doc: `eval.frontier.identity.settings_diff`, which names the first that differs, budgets included). Records
written before records carried their settings are checked by their fingerprint (it must be this run's with DIR's
methods), and each common document must have the same task, prompt length and Full task score.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from flashmemory.errors import UserError
from flashmemory.eval.records import DOCS_DIR, check_alike, check_body, found_kind

SHOW = ("task_score", "agreement", "mass", "mean_pages", "device_bytes", "h2d_per_token")
ARMS = ("Full", "HiSparse", "HiSparse+prefetch")  # rows every frontier run has besides its --methods


def load_records(out_dir: str, fmt: str, fields: tuple[str, ...] = ()) -> dict[int, dict]:
    """{document index: record} of every finished document under out_dir/docs (any configuration): UserError
    naming --compare when out_dir is no directory or another command's, or naming a record that is not a
    readable frontier record (`eval.records.check_body`); a record that does not parse (a torn write) is skipped."""
    from flashmemory.eval.records import KINDS
    from flashmemory.outdir import dir_kind

    d = Path(out_dir)
    if not d.is_dir():
        raise UserError(f"--compare {out_dir}: not a directory")
    kind = dir_kind(d, "--compare", found_kind(d))
    if kind is not None and kind != KINDS[fmt]:
        raise UserError(f"--compare {out_dir}: holds the output of `flashmemory {kind}`, not of a frontier run")
    out, by_path = {}, {}
    for p in sorted((d / DOCS_DIR).glob("*.json")):
        if not p.stem.isdigit():
            continue
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or rec.get("format") != fmt:
            raise UserError(f"--compare {out_dir}: {p} is not a frontier record (field format)")
        check_body(p, rec, None, fields)
        out[int(p.stem)] = by_path[p] = rec
    check_alike(by_path)
    return out


def check_same_documents(mine: dict, other: dict, fc, other_dir: str) -> None:
    """UserError naming --compare, the document and the first setting (or fact) in which `other` (a record of
    other_dir) was decoded differently from `mine`; fc: this run's FrontierConfig."""
    from flashmemory.eval.frontier.identity import SHIPPED, legacy_fingerprint, settings_diff

    i = mine["index"]
    where = f"--compare {other_dir}: document {i}"
    if sorted(map(float, mine["budgets"])) != sorted(map(float, other["budgets"])):
        raise UserError(
            f"{where}: budgets differ (--budgets {','.join(other['budgets'])} there, {','.join(mine['budgets'])} here)"
        )
    has_mine, has_other = "settings" in mine, "settings" in other
    if has_mine and has_other:
        diff = settings_diff(mine["settings"], other["settings"])
        if diff:
            raise UserError(f"{where}: {diff}; compare runs of the same settings but --methods")
    elif has_mine != has_other:
        raise UserError(
            f"{where}: its record {'there' if has_mine else 'here'} predates records carrying their settings, so "
            "the two runs' settings cannot be checked; compare runs written by the same version"
        )
    elif fc is not None:  # both from before settings were stored: their fingerprints must agree but for --methods
        b0 = next(iter(other["budgets"]))
        methods = tuple(m for m in other["budgets"][b0] if m not in ARMS)
        if other.get("fingerprint") != legacy_fingerprint(replace(fc, methods=methods), SHIPPED):
            raise UserError(
                f"{where}: was written with settings other than this run's (its fingerprint "
                f"{other.get('fingerprint')} is not this run's with --methods {','.join(methods)}); "
                "rerun both with this version to see which"
            )
    if other.get("task") != mine.get("task"):
        raise UserError(f"{where}: is a {other.get('task')} document there, a {mine.get('task')} one here")
    b0 = next(iter(mine["budgets"]))
    if other.get("prompt_len") != mine.get("prompt_len") or other["budgets"][b0]["Full"].get("task_score") != mine[
        "budgets"
    ][b0]["Full"].get("task_score"):
        raise UserError(f"{where} differs from this run's (prompt length or Full's task score)")


def compare_lines(recs: list[dict], other_dir: str, fmt: str, base: str = "FlashMemory", fc=None) -> list[str]:
    """Markdown: per budget, `base` and Full of this run beside the methods only `other_dir` ran, each with its
    task accuracy (Wilson 95%), agreement, top-k mass, mean resident pages, device and H2D bytes, over the
    documents both runs finished (n stated). Refused (UserError) unless both decoded the same documents the same
    way (`check_same_documents`); fc: this run's FrontierConfig (checks records without settings)."""
    from flashmemory.eval.frontier.markdown import _ci, _fmt_bytes
    from flashmemory.eval.frontier.report import _flat
    from flashmemory.eval.harness import mean_rows

    other = load_records(other_dir, fmt)
    common = [r for r in recs if r["index"] in other]
    head = ["", f"## {base} beside the methods of `{other_dir}` (same documents)", ""]
    if not common:
        return head + [f"No finished document of {other_dir} is among this run's ({len(recs)} finished)."]
    for r in common:
        check_same_documents(r, other[r["index"]], fc, other_dir)
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
