"""Atomic, resumable writing of dump documents.

Commit protocol: the doc file is written to a hidden temp name in the same directory, fsynced, and
`os.replace`d into place; only then is its line (with the file's size) appended to `server_metadata.jsonl`
(one write + fsync). So the metadata line is the commit record. The directory is locked for the writer's
life (`outdir.DirLock`). On open, `DumpWriter` repairs what a crash (or an older, unlocked run) can leave:
  - stray temp files of this project are deleted: only names `outdir.is_own_tmp` verifies (a tagged name
    `tmp_name` made), never a user's `.tmp-notes.txt`; temp files of the older, untagged naming are left;
  - a torn last metadata line, a verbatim repeated line, and a line whose file vanished are dropped
    (that document is redone);
  - a committed file that is truncated (size differs from the one recorded at commit, or from what its
    own header describes) or that holds another document than its line says is moved to `.quarantine/`
    and its document redone;
  - a `doc_*.safetensors` without a line (interrupted between rename and append, or a lost
    `server_metadata.jsonl`) is adopted when it loads and validates, else moved to `.quarantine/`;
  - upstream `doc_*.pkl` files without a line are left alone.
Nothing else is ever deleted. Items that failed (`record_failure`) are listed in `failed_items.jsonl`, so a
rerun skips them instead of failing on the same item forever.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import torch

from flashmemory.dump.errors import DumpFormatError
from flashmemory.dump.format import FORMAT, TOPK_STEPS_KEY, DumpDoc, doc_filename, load_doc
from flashmemory.dump.metadata import DOC_RE, METADATA_FILE, dedupe, metadata_lines, safetensors_problem
from flashmemory.dump.outdir import LEGACY_TMP_RE, DirLock, is_own_tmp, prepare_output_dir, quarantine, tmp_name

FAILED_FILE = "failed_items.jsonl"


def doc_tensors(doc: DumpDoc) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Flatten a DumpDoc to (safetensors tensors, string metadata); hidden is stored as bf16."""
    t: dict[str, torch.Tensor] = {}
    for L in doc.target_layers:
        t[f"hidden_layer_{L}"] = doc.hidden[L].to(torch.bfloat16).contiguous()
        t[f"positions_layer_{L}"] = doc.positions[L].to(torch.int64).contiguous()
        t[f"compk_layer_{L}"] = doc.compk[L].to(torch.uint8).contiguous()
    t["label_indices"] = doc.label_indices.to(torch.int32).contiguous()
    t["label_scores"] = doc.label_scores.to(torch.int32).contiguous()
    t["label_pointers"] = doc.label_pointers.to(torch.int32).contiguous()
    for (L, step), lg in sorted(doc.native_logits.items()):
        t[f"logits_layer_{L}_token_{step}"] = lg.float().contiguous()
    if doc.input_ids is not None:
        t["input_ids"] = doc.input_ids.to(torch.int64).contiguous()
    if doc.native_topk:
        t[TOPK_STEPS_KEY] = doc.native_topk_steps.to(torch.int32).contiguous()
        for C, (idx, val) in sorted(doc.native_topk.items()):
            t[f"native_topk_idx_layer_{C}"] = idx.to(torch.int32).contiguous()
            t[f"native_topk_val_layer_{C}"] = val.to(torch.float32).contiguous()
    meta = {
        "format": FORMAT,
        "doc_index": str(doc.doc_index),
        "rid": doc.rid,
        "n_prompt_blocks": str(doc.n_prompt_blocks),
        "ratio": str(doc.ratio),
        "topp": repr(float(doc.topp)),
        "min_layers": str(doc.min_layers),
        "target_csa_layers": json.dumps(doc.target_layers),
        "n_decode_tokens": str(doc.n_tokens),
    }
    return t, meta


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(str(d), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _as_oserror(e: Exception, p: Path) -> OSError:
    """safetensors reports I/O failures (a full disk) as SafetensorError: the OSError they stand for."""
    m = re.search(r"os error (\d+)", str(e))
    code = int(m.group(1)) if m else errno.EIO
    return OSError(code, os.strerror(code), str(p))


def save_doc_file(
    path: str | os.PathLike, doc: DumpDoc, *, dir_fd: int | None = None, header: dict[str, str] | None = None
) -> Path:
    """Validate and atomically write one doc file (temp + fsync + os.replace). Also used by the server side.

    dir_fd: write `path`'s file name into this open directory (the dump server's confined write,
    `confine.write_file_at`: nothing on the way is looked up by path, no symlink is followed); `path` then
    only names the file in messages. header: extra string metadata for the file's header (additive)."""
    from safetensors.torch import save, save_file

    p = Path(path)
    doc.validate(str(p))
    tensors, meta = doc_tensors(doc)
    meta.update(header or {})
    if dir_fd is not None:
        from flashmemory.dump.confine import write_file_at

        try:
            data = save(tensors, metadata=meta)
        except Exception as e:  # noqa: BLE001 - see _as_oserror
            raise _as_oserror(e, p) from e
        write_file_at(dir_fd, p.name, data, str(p))
        return p
    tmp = p.with_name(tmp_name(p.name))
    try:
        try:
            save_file(tensors, str(tmp), metadata=meta)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - see _as_oserror
            raise _as_oserror(e, p) from e
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # safetensors creates 0600; dumps are shared with the training job
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(p.parent)
    return p


def metadata_record(doc: DumpDoc, filename: str, **extra: object) -> dict:
    """The `server_metadata.jsonl` line for a document (upstream fields first, then extras)."""
    rec = {
        "doc_index": doc.doc_index,
        "rid": doc.rid,
        "filename": filename,
        "n_prompt_blocks": doc.n_prompt_blocks,
        "n_decode_tokens": doc.n_tokens,
        "n_total_labels": int(doc.label_indices.numel()),
        "hidden_shapes": {str(L): list(doc.hidden[L].shape) for L in doc.target_layers},
        "compk_shapes": {str(L): list(doc.compk[L].shape) for L in doc.target_layers},
        "logits_shapes": {
            f"logits_layer_{L}_token_{t}": list(v.shape) for (L, t), v in sorted(doc.native_logits.items())
        },
        "target_csa_layers": doc.target_layers,
        "native_topk_steps": int(doc.native_topk_steps.numel()) if doc.native_topk else 0,
        "native_topk_layers": sorted(doc.native_topk),
        "ratio": doc.ratio,
        "topp": doc.topp,
        "min_layers": doc.min_layers,
    }
    rec.update(extra)
    return rec


def _header_meta(path: Path) -> dict:
    """The string metadata of a safetensors file's header (empty when unreadable)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 - safetensors raises several types; the caller reports the file as suspect
        return {}


def _source_item(rid: str) -> dict:
    """`source` / `item_index` of a document from its rid ("file.jsonl:12", as `run_dump` names them)."""
    src, _, idx = rid.rpartition(":")
    return {"source": src, "item_index": int(idx)} if src and idx.isdigit() else {}


def _append_line(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


class DumpWriter:
    """Owns one output directory: checks and locks it, recovers it on open, then commits documents one at a
    time. Use as a context manager (or call `close`) to drop the lock; it also drops when the process ends."""

    def __init__(self, output_dir: str | os.PathLike):
        self.dir = Path(output_dir)
        prepare_output_dir(self.dir)
        self._lock = DirLock(self.dir)
        self.meta_path = self.dir / METADATA_FILE
        self.failed_path = self.dir / FAILED_FILE
        self.recovered: list[str] = self._recover()
        self.records: list[dict] = dedupe(metadata_lines(self.dir), str(self.meta_path))

    def close(self) -> None:
        self._lock.release()

    def __enter__(self) -> "DumpWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- recovery -----------------------------------------------------------------------------------------
    def _recover(self) -> list[str]:
        notes: list[str] = []
        for p in sorted(self.dir.iterdir()):
            if is_own_tmp(p.name) and p.is_file() and not p.is_symlink():
                p.unlink()
                notes.append(f"removed stray temp file {p.name}")
            elif LEGACY_TMP_RE.match(p.name):
                notes.append(
                    f"left {p.name} alone: it looks like an older version's temp file, but carries no "
                    "tag to prove it; remove it yourself if it is one"
                )
        raw = self.meta_path.read_text() if self.meta_path.is_file() else ""
        lines = metadata_lines(self.dir)
        kept: list[dict] = []
        by_index: dict[int, dict] = {}
        for lineno, r in lines:
            where = f"{METADATA_FILE}:{lineno} (doc {r['doc_index']})"
            prev = by_index.get(int(r["doc_index"]))
            if prev == r:
                notes.append(f"{where}: dropped a repeated line")
                continue
            problem = self._line_problem(r)
            if problem is None and prev is not None:
                problem = "another line already claims this doc_index and its file"
            if problem is not None:
                notes.append(f"{where}: {problem}; will redo it")
                continue
            by_index[int(r["doc_index"])] = r
            kept.append(r)
        listed = {r["filename"] for r in kept}
        for p in sorted(self.dir.iterdir()):
            m = DOC_RE.match(p.name)
            if not m or p.name in listed or not p.is_file():
                continue
            if m.group(2) == "pkl":
                notes.append(f"left {p.name} alone: an upstream file without a metadata line")
                continue
            rec, why = self._adoptable(p, int(m.group(1)))
            if rec is not None and int(rec["doc_index"]) not in by_index:
                kept.append(rec)
                by_index[int(rec["doc_index"])] = rec
                notes.append(f"adopted {p.name}: complete and valid, but it had no metadata line")
            else:
                notes.append(quarantine(self.dir, p, f"{why or 'its doc_index is taken'}; will redo it"))
        kept.sort(key=lambda r: int(r["doc_index"]))
        rewritten = "".join(json.dumps(r) + "\n" for r in kept)
        if rewritten != raw and (raw.strip() or kept):
            if len(kept) == len(lines) and raw and not raw.endswith("\n"):
                notes.append(f"dropped a torn last line of {METADATA_FILE}")
            self._write_metadata(kept)
        return notes

    def _line_problem(self, r: dict) -> str | None:
        """Why a metadata line cannot stand (its file is missing, cut, or another document), or None. A file
        that is there but wrong is moved aside here; upstream .pkl files are taken as they are."""
        p = self.dir / r["filename"]
        if not p.is_file():
            return f"names missing {r['filename']}"
        if p.suffix != ".safetensors":
            return None
        problem = safetensors_problem(p)
        size = r.get("file_size")
        if problem is None and isinstance(size, int) and p.stat().st_size != size:
            problem = f"{p.stat().st_size} bytes, {size} recorded at commit"
        if problem is None:
            head = _header_meta(p)
            if head.get("doc_index") != str(r["doc_index"]) or ("rid" in r and head.get("rid") != r["rid"]):
                # two unlocked writers wrote one doc_index: the file holds the other line's document
                return (
                    f"{r['filename']} holds doc {head.get('doc_index')} rid {head.get('rid')!r}, not rid "
                    f"{r.get('rid')!r}; line dropped"
                )
            return None
        return quarantine(self.dir, p, f"committed file is damaged ({problem})")

    def _adoptable(self, p: Path, index: int) -> tuple[dict | None, str]:
        """(metadata line, "") for an unlisted doc file that is whole and valid, else (None, why not)."""
        problem = safetensors_problem(p)
        if problem:
            return None, f"no metadata line and {problem}"
        try:
            doc = load_doc(p)
        except DumpFormatError as e:
            return None, f"no metadata line and it does not load ({str(e).removeprefix(str(p) + ': ')})"
        if doc.doc_index != index:
            return None, f"no metadata line and it holds doc_index {doc.doc_index}"
        h = _header_meta(p).get("item_sha256")
        extra = {"item_sha256": h} if isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) else {}
        return metadata_record(
            doc, p.name, **_source_item(doc.rid), **extra, file_size=p.stat().st_size, adopted=True
        ), ""

    def _write_metadata(self, records: list[dict]) -> None:
        tmp = self.meta_path.with_name(tmp_name(METADATA_FILE))
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.meta_path)
        _fsync_dir(self.dir)

    # --- state --------------------------------------------------------------------------------------------
    @property
    def next_doc_index(self) -> int:
        """One past every doc index in the metadata and on disk (an upstream .pkl keeps its number)."""
        on_disk = [int(m.group(1)) for p in self.dir.iterdir() if (m := DOC_RE.match(p.name))]
        return max([int(r["doc_index"]) for r in self.records] + on_disk, default=-1) + 1

    def done_items(self, source: str) -> set[int]:
        """Input item indices of `source` (input file name) that already have a complete document (any content)."""
        return set(self.done_keys(source))

    def done_keys(self, source: str) -> dict[int, set[str | None]]:
        """item index -> the `item_sha256` (content hash, `InputItem.content_sha256`) of each complete document of
        `source` at that index; None stands for a document of an older version, which recorded no hash."""
        out: dict[int, set[str | None]] = {}
        for r in self.records:
            if r.get("source") == source and "item_index" in r:
                h = r.get("item_sha256")
                out.setdefault(int(r["item_index"]), set()).add(h if isinstance(h, str) else None)
        return out

    def failed_items(self, source: str, digests: dict[int, str] | None = None) -> dict[int, str]:
        """item index -> reason, for items of `source` that failed in an earlier run and are not done since.

        digests (item index -> content hash of the item now): a failure recorded with another hash is of other
        content (the input changed) and does not count; failures recorded without a hash count by index."""
        out: dict[int, str] = {}
        if self.failed_path.is_file():
            for line in self.failed_path.read_text(errors="replace").splitlines():
                try:
                    r = json.loads(line)
                    if r.get("source") != source:
                        continue
                    i, h = int(r["item_index"]), r.get("item_sha256")
                    if digests is not None and isinstance(h, str) and digests.get(i) != h:
                        continue
                    out[i] = str(r.get("reason", ""))
                except (ValueError, TypeError, KeyError, AttributeError):
                    continue  # a torn or foreign line: that item is simply tried again
        done = self.done_keys(source)
        return {
            i: why
            for i, why in out.items()
            if not (done.get(i) and (digests is None or None in done[i] or digests.get(i) in done[i]))
        }

    # --- writing ------------------------------------------------------------------------------------------
    def record_failure(self, source: str, item_index: int, reason: str, item_sha256: str | None = None) -> None:
        """Note that an item failed, so a rerun skips it (unless asked to retry, or its content changed)."""
        rec: dict = {"source": source, "item_index": int(item_index), "reason": reason[:500]}
        if item_sha256 is not None:
            rec["item_sha256"] = item_sha256
        _append_line(self.failed_path, rec)

    def commit(self, doc: DumpDoc, **extra: object) -> dict:
        """Write the doc file atomically, then append its metadata line (with the file size). Returns the line."""
        if any(int(r["doc_index"]) == doc.doc_index for r in self.records):
            raise DumpFormatError(f"{self.dir}: doc_index {doc.doc_index} already committed")
        name = doc_filename(doc.doc_index)
        head = {"item_sha256": str(extra["item_sha256"])} if extra.get("item_sha256") else None
        path = save_doc_file(self.dir / name, doc, header=head)  # the hash survives a crash before the line
        rec = metadata_record(doc, name, **extra, file_size=path.stat().st_size)
        _append_line(self.meta_path, rec)
        self.records.append(rec)
        return rec
