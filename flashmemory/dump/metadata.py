"""Reading `server_metadata.jsonl`, the commit record of a dump directory.

A document is complete once its line is in the file. Every reader (train, eval, verify, the writer's
resume) goes through `metadata_lines`, so the same rules hold everywhere:
  - `filename` must be a plain file name inside the dump directory (no directory part, no `..`);
  - a torn last line (a crash mid-append) is ignored, any other bad line is an error naming its number;
  - a line repeated verbatim counts once; two different lines for one doc_index or one filename are an
    error naming both line numbers (`read_metadata`), never a silently doubled document.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from flashmemory.dump.errors import DumpFormatError

METADATA_FILE = "server_metadata.jsonl"
DOC_RE = re.compile(r"^doc_(\d{5,})\.(safetensors|pkl)$")


def check_filename(name: object, where: str) -> str:
    """`name` if it is a plain file name (the doc lives in the dump dir itself); else DumpFormatError."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise DumpFormatError(
            f"{where}: filename {name!r} is outside the dump directory (a metadata line "
            "must name a file in the directory itself)"
        )
    return name


def metadata_lines(dump_dir: str | os.PathLike) -> list[tuple[int, dict]]:
    """(line number, record) of every well-formed line, in file order, duplicates included.

    Each record has an integer `doc_index` >= 0 and a safe `filename`. A torn last line is skipped.
    """
    path = Path(dump_dir) / METADATA_FILE
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DumpFormatError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            if i == len(lines):  # a torn last line (crash mid-append): that document is not complete
                break
            raise DumpFormatError(f"{path}:{i}: not valid JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(rec, dict) or "doc_index" not in rec or "filename" not in rec:
            raise DumpFormatError(f"{path}:{i}: expected an object with doc_index and filename")
        di = rec["doc_index"]
        if isinstance(di, bool) or not isinstance(di, int) or di < 0:
            raise DumpFormatError(f"{path}:{i}: doc_index={di!r} is not an integer >= 0")
        check_filename(rec["filename"], f"{path}:{i}")
        out.append((i, rec))
    return out


def dedupe(lines: list[tuple[int, dict]], source: str) -> list[dict]:
    """One record per document: verbatim repeats collapse; conflicting lines raise DumpFormatError."""
    by_index: dict[int, tuple[int, dict]] = {}
    by_name: dict[str, tuple[int, dict]] = {}
    for i, rec in lines:
        for table, key, what in ((by_index, rec["doc_index"], "doc_index"), (by_name, rec["filename"], "filename")):
            seen = table.get(key)
            if seen is not None and seen[1] != rec:
                raise DumpFormatError(
                    f"{source}: lines {seen[0]} and {i} both claim {what} {key!r} with different "
                    "contents (two writers on one directory?); rerun `flashmemory dump` on it to "
                    "repair, or remove the wrong line"
                )
            table.setdefault(key, (i, rec))
    return [rec for _, rec in sorted(by_index.values(), key=lambda x: x[1]["doc_index"])]


def read_metadata(dump_dir: str | os.PathLike) -> list[dict]:
    """The metadata lines of complete documents, one per doc, sorted by doc_index (a torn final line is ignored)."""
    return dedupe(metadata_lines(dump_dir), str(Path(dump_dir) / METADATA_FILE))


def list_docs(dump_dir: str | os.PathLike) -> list[Path]:
    """Paths of complete documents (file present and listed in the metadata), sorted by doc_index."""
    d = Path(dump_dir)
    if not d.is_dir():
        raise DumpFormatError(f"{d}: no such dump directory")
    return [d / r["filename"] for r in read_metadata(d) if (d / r["filename"]).is_file()]


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why a .safetensors file is not whole (truncated, extended, bad header), or None when its size matches
    the header. Reads only the header, so it is cheap enough to run on every file at resume."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                return f"header length {n} does not fit in {size} bytes (truncated)"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return "header is not valid JSON (truncated or corrupt)"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if not all(isinstance(e, int) for e in ends):
        return "header has non-integer data offsets"
    want = 8 + n + max(ends, default=0)
    if size != want:
        return f"{size} bytes, the header describes {want} ({'truncated' if size < want else 'trailing bytes'})"
    return None
