"""Atomic, resumable writing of dump documents.

Commit protocol: the doc file is written to a hidden temp name in the same directory, fsynced, and
`os.replace`d into place; only then is its line appended to `server_metadata.jsonl` (one write +
fsync). So the metadata line is the commit record. On open, `DumpWriter` repairs what a crash can
leave behind: stray temp files and doc files without a metadata line are removed (their documents
are redone), a torn last metadata line is dropped, and lines whose doc file vanished are dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from flashmemory.dump.format import (FORMAT, METADATA_FILE, TOPK_STEPS_KEY, _DOC_RE, DumpDoc, DumpFormatError,
                                     doc_filename, read_metadata)

TMP_PREFIX = ".tmp-"


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
        "format": FORMAT, "doc_index": str(doc.doc_index), "rid": doc.rid,
        "n_prompt_blocks": str(doc.n_prompt_blocks), "ratio": str(doc.ratio), "topp": repr(float(doc.topp)),
        "min_layers": str(doc.min_layers), "target_csa_layers": json.dumps(doc.target_layers),
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


def save_doc_file(path: str | os.PathLike, doc: DumpDoc) -> Path:
    """Validate and atomically write one doc file (temp + fsync + os.replace). Also used by the server side."""
    from safetensors.torch import save_file
    p = Path(path)
    doc.validate(str(p))
    tensors, meta = doc_tensors(doc)
    tmp = p.with_name(f"{TMP_PREFIX}{p.name}.{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
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
        "doc_index": doc.doc_index, "rid": doc.rid, "filename": filename,
        "n_prompt_blocks": doc.n_prompt_blocks, "n_decode_tokens": doc.n_tokens,
        "n_total_labels": int(doc.label_indices.numel()),
        "hidden_shapes": {str(L): list(doc.hidden[L].shape) for L in doc.target_layers},
        "compk_shapes": {str(L): list(doc.compk[L].shape) for L in doc.target_layers},
        "logits_shapes": {f"logits_layer_{L}_token_{t}": list(v.shape) for (L, t), v in sorted(doc.native_logits.items())},
        "target_csa_layers": doc.target_layers,
        "native_topk_steps": int(doc.native_topk_steps.numel()) if doc.native_topk else 0,
        "native_topk_layers": sorted(doc.native_topk),
        "ratio": doc.ratio, "topp": doc.topp, "min_layers": doc.min_layers,
    }
    rec.update(extra)
    return rec


class DumpWriter:
    """Owns one output directory: recovers it on open, then commits documents one at a time."""

    def __init__(self, output_dir: str | os.PathLike):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta_path = self.dir / METADATA_FILE
        self.recovered: list[str] = self._recover()
        self.records: list[dict] = read_metadata(self.dir)

    def _recover(self) -> list[str]:
        notes = []
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith(TMP_PREFIX):
                p.unlink()
                notes.append(f"removed stray temp file {p.name}")
        raw = self.meta_path.read_text() if self.meta_path.is_file() else ""
        records = read_metadata(self.dir)
        kept = [r for r in records if (self.dir / r["filename"]).is_file()]
        for r in records:
            if r not in kept:
                notes.append(f"metadata line for doc {r['doc_index']} names missing {r['filename']}; will redo it")
        rewritten = "".join(json.dumps(r) + "\n" for r in kept)
        if rewritten != raw and (raw.strip() or kept):
            if len(kept) == len(records) and not raw.endswith("\n"):
                notes.append(f"dropped a torn last line of {METADATA_FILE}")
            self._write_metadata(kept)
        listed = {r["filename"] for r in kept}
        for p in sorted(self.dir.iterdir()):
            if _DOC_RE.match(p.name) and p.name not in listed:
                p.unlink()
                notes.append(f"removed {p.name}: no metadata line (interrupted before commit); will redo it")
        return notes

    def _write_metadata(self, records: list[dict]) -> None:
        tmp = self.meta_path.with_name(f"{TMP_PREFIX}{METADATA_FILE}.{os.getpid()}")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.meta_path)
        _fsync_dir(self.dir)

    @property
    def next_doc_index(self) -> int:
        return max((int(r["doc_index"]) for r in self.records), default=-1) + 1

    def done_items(self, source: str) -> set[int]:
        """Input item indices of `source` (input file name) that already have a complete document."""
        return {int(r["item_index"]) for r in self.records if r.get("source") == source and "item_index" in r}

    def commit(self, doc: DumpDoc, **extra: object) -> dict:
        """Write the doc file atomically, then append its metadata line. Returns the line."""
        if any(int(r["doc_index"]) == doc.doc_index for r in self.records):
            raise DumpFormatError(f"{self.dir}: doc_index {doc.doc_index} already committed")
        name = doc_filename(doc.doc_index)
        save_doc_file(self.dir / name, doc)
        rec = metadata_record(doc, name, **extra)
        with open(self.meta_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(rec)
        return rec
