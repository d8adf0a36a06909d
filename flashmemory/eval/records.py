"""Per-document records of a resumable run (`eval quality`, `eval frontier`): one JSON file per finished document
under `out/docs/NNNNN.json`, each carrying its run's format tag and configuration fingerprint.

A record that cannot be read, or lacks the format tag, counts as not done (the rerun redoes it); a record from
another configuration stops the run with a UserError naming the file, so two configurations never mix in one dir.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from flashmemory.errors import UserError

DOCS_DIR = "docs"


def read_record(path: Path, fp: str, fmt: str, run: str, out_flag: str) -> dict | None:
    """The record at `path`, or None when unreadable or not `fmt`; `run` and `out_flag` name the command in the
    error for a foreign fingerprint (e.g. "a frontier run", "--out")."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("format") != fmt or "budgets" not in rec:
        return None
    if rec.get("fingerprint") != fp:
        raise UserError(
            f"{path}: written by {run} with another configuration (fingerprint "
            f"{rec.get('fingerprint')}, this run {fp}); use another {out_flag}"
        )
    return rec


def load_records(out: Path, fp: str, fmt: str, run: str, out_flag: str) -> dict[int, dict]:
    """{document index: record} of the finished documents under out/docs."""
    done = {}
    for p in sorted((out / DOCS_DIR).glob("*.json")):
        if p.stem.isdigit():
            rec = read_record(p, fp, fmt, run, out_flag)
            if rec is not None:
                done[int(p.stem)] = rec
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
