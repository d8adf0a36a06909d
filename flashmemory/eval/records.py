"""Per-document records of a resumable run (`eval quality`, `eval frontier`): one JSON file per finished document
under `out/docs/NNNNN.json`, each carrying its run's format tag and configuration fingerprint.

A record that cannot be parsed (a write torn before records were written atomically) counts as not done and is
redone. Everything else that is not this run's finished document stops the run with one line naming the file and
the field: a record of another command or format, of another configuration (so two configurations never mix in
one dir), or one whose body the report cannot read (no budgets, another budget set, a method row without
metrics, a metric that is not a number, methods or metrics unlike the dir's other records).

The output dir itself carries its command's kind (`flashmemory.outdir.claim_kind`): `claim_run_dir` refuses an
`eval quality` dir to `eval frontier` and the reverse, recognising an unmarked dir by its records' format tags.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from flashmemory.errors import UserError

DOCS_DIR = "docs"
KINDS = {"flashmemory-quality/1": "eval quality", "flashmemory-frontier/1": "eval frontier"}  # format -> command
MAX_PER_TASK = 100_000  # documents per task: a plan this long already takes months at ~30 s a document
_FORMAT_RE = re.compile(r'"format":\s*"([^"]*)"')


def check_n_per_task(n: int) -> None:
    """--n-per-task must lie in [1, MAX_PER_TASK] (the plan is a list of every document)."""
    if not 1 <= n <= MAX_PER_TASK:
        raise UserError(f"--n-per-task {n}: must lie in [1, {MAX_PER_TASK}]")


def check_tasks(tasks: tuple[str, ...], allowed: tuple[str, ...], whose: str) -> None:
    """The one --tasks check of `eval quality` and `eval frontier`: every name a suite task, among `allowed`
    (the model's tasks; `whose` names them, e.g. "the trained model's"), none twice. UserError naming --tasks."""
    from flashmemory.tasks.suite import TASKS

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"--tasks: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    bad = [t for t in tasks if t not in allowed]
    if bad:
        raise UserError(f"--tasks: {', '.join(bad)} not among {whose} tasks ({', '.join(allowed)})")
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:
        raise UserError(f"--tasks: {', '.join(twice)} given more than once")


def found_kind(out: Path) -> str | None:
    """The command whose records an output dir holds, from the first record with a known format tag (the tag
    opens every record), None when it holds none."""
    for p in sorted((out / DOCS_DIR).glob("*.json")):
        try:
            with open(p, "rb") as f:
                head = f.read(256).decode("utf-8", "replace")
        except OSError:
            continue
        m = _FORMAT_RE.search(head)
        if m and m.group(1) in KINDS:
            return KINDS[m.group(1)]
    return None


def claim_run_dir(out: Path, fmt: str, out_flag: str) -> None:
    """Refuse `out` when it holds another command's run, else mark it as `fmt`'s command's (under its DirLock)."""
    from flashmemory.outdir import claim_kind

    claim_kind(out, KINDS[fmt], out_flag, found_kind(out))


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_body(path: Path, rec: dict, budget_keys: tuple[str, ...] | None, fields: tuple[str, ...]) -> None:
    """UserError naming `path` and the field when the record's body is not what the report reads: `fields` (and
    index, task) present, budgets a non-empty {budget: {method: {metric: value}}} with exactly `budget_keys`
    (when given), a Full row at every budget, each row a non-empty dict whose task_score is a number and whose
    values are numbers, booleans, null, lists or dicts."""
    if not isinstance(rec.get("index"), int) or not isinstance(rec.get("task"), str):
        raise UserError(f"{path}: field index or task missing or of the wrong type; not a finished record")
    if path.stem.isdigit() and rec["index"] != int(path.stem):
        raise UserError(f"{path}: field index is {rec['index']}, but the file holds document {int(path.stem)}")
    for f in fields:
        if not _number(rec.get(f)):
            raise UserError(f"{path}: field {f} missing or not a number")
    budgets = rec.get("budgets")
    if not isinstance(budgets, dict) or not budgets:
        raise UserError(f"{path}: field budgets missing or empty; not a finished record")
    if budget_keys is not None and sorted(budgets) != sorted(budget_keys):
        raise UserError(
            f"{path}: field budgets holds {', '.join(budgets)}, this run's budgets are {', '.join(budget_keys)}"
        )
    for b, rows in budgets.items():
        if not isinstance(rows, dict) or not isinstance(rows.get("Full"), dict):
            raise UserError(f"{path}: field budgets.{b} has no Full row")
        for m, row in rows.items():
            if not isinstance(row, dict) or not row:
                raise UserError(f"{path}: field budgets.{b}.{m} holds no metrics")
            if not _number(row.get("task_score")):
                raise UserError(f"{path}: field budgets.{b}.{m}.task_score missing or not a number")
            for k, v in row.items():
                if not (v is None or isinstance(v, (int, float, bool, list, dict))):
                    raise UserError(f"{path}: field budgets.{b}.{m}.{k} is not a number")
                if isinstance(v, float) and math.isinf(v):
                    raise UserError(f"{path}: field budgets.{b}.{m}.{k} is infinite")


def check_alike(recs: dict[Path, dict]) -> None:
    """UserError naming the first record whose budgets, methods or metric names differ from the first record's
    (the report averages metric by metric over documents: a missing one would end it)."""
    first = None
    for path, rec in recs.items():
        shape = {b: {m: sorted(row) for m, row in rows.items()} for b, rows in rec["budgets"].items()}
        if first is None:
            first, ref = shape, path
            continue
        for b, rows in shape.items():
            if list(rows) != list(first.get(b, {})):
                raise UserError(
                    f"{path}: field budgets.{b} holds methods {', '.join(rows)}; {ref.name} holds "
                    f"{', '.join(first.get(b, {}))}"
                )
            for m, keys in rows.items():
                if keys != first[b][m]:
                    diff = sorted(set(keys) ^ set(first[b][m]))
                    raise UserError(
                        f"{path}: field budgets.{b}.{m}: metrics {', '.join(diff)} in one of it and {ref.name} only"
                    )


def read_record(
    path: Path,
    fp: str,
    fmt: str,
    run: str,
    out_flag: str,
    budget_keys: tuple[str, ...] | None = None,
    fields: tuple[str, ...] = ("seconds",),
    legacy: Callable[[Path, dict], bool] | None = None,
) -> dict | None:
    """The record at `path`, or None when it does not parse (a torn write: redone). `run` and `out_flag` name
    the command in the errors (e.g. "a frontier run", "--out"); legacy(path, rec) may accept a record whose
    fingerprint differs (an older scheme naming the same configuration) or raise its own UserError."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("format") != fmt:
        got = rec.get("format") if isinstance(rec, dict) else type(rec).__name__
        raise UserError(f"{path}: field format is {got!r}, not {fmt!r}: not a record of {run}; use another {out_flag}")
    if rec.get("fingerprint") != fp and not (legacy is not None and legacy(path, rec)):
        raise UserError(
            f"{path}: written by {run} with another configuration (fingerprint "
            f"{rec.get('fingerprint')}, this run {fp}); use another {out_flag}"
        )
    check_body(path, rec, budget_keys, fields)
    return rec


def load_records(
    out: Path,
    fp: str,
    fmt: str,
    run: str,
    out_flag: str,
    budget_keys: tuple[str, ...] | None = None,
    fields: tuple[str, ...] = ("seconds",),
    legacy: Callable[[Path, dict], bool] | None = None,
) -> dict[int, dict]:
    """{document index: record} of the finished documents under out/docs (`read_record` each, then `check_alike`)."""
    done, by_path = {}, {}
    for p in sorted((out / DOCS_DIR).glob("*.json")):
        if p.stem.isdigit():
            rec = read_record(p, fp, fmt, run, out_flag, budget_keys, fields, legacy)
            if rec is not None:
                done[int(p.stem)] = by_path[p] = rec
    check_alike(by_path)
    return done


def name_list(raw: str | None) -> tuple[str, ...]:
    """A comma-separated flag value as a tuple of non-empty, stripped names ("" or None -> ())."""
    return tuple(x.strip() for x in (raw or "").split(",") if x.strip())


def file_digest(path: str, what: str) -> str:
    """sha256 (hex) of a file's bytes: a run keys on what the file holds, not on the name it is given by (the same
    file under another path is the same run; another file at the same path is not). UserError naming `what` and
    the path when it cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise UserError(f"{what} {path}: cannot be read ({e.strerror or e})") from e
    return h.hexdigest()
