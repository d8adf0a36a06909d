"""Which documents `flashmemory eval` scores: held-out ones by default, and it says which.

A retriever checkpoint written by `flashmemory train` records the documents it was trained and selected
on (metadata `trained_on`: {"train"|"val": [[absolute data_dir, doc ids or null], ...]}). `eval --dump DIR`
then drops those documents unless `--all-docs` is given; `eval --data-config FILE --split NAME` scores one
split of a data config (default `test`). Either way the chosen split is described in one printed line.
"""

from __future__ import annotations

import json
from pathlib import Path


def seen_doc_ids(meta: dict[str, str], dump_dir: str | Path) -> set[int] | None:
    """Doc ids of `dump_dir` the checkpoint trained or validated on (every id: {-1}); None if unrecorded."""
    raw = meta.get("trained_on")
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
        entries = [e for split in ("train", "val") for e in rec.get(split, [])]
    except (json.JSONDecodeError, AttributeError, TypeError):
        raise ValueError(f"checkpoint metadata 'trained_on' is not valid JSON: {raw[:80]!r}") from None
    here = str(Path(dump_dir).resolve())
    out: set[int] = set()
    for d, ids in entries:
        if d == here:
            if ids is None:
                return {-1}
            out |= {int(i) for i in ids}
    return out


def doc_index(path: Path) -> int:
    return int(path.stem.split("_")[1])


def heldout_paths(
    paths: list[Path], meta: dict[str, str], dump_dir: str | Path, all_docs: bool
) -> tuple[list[Path], str]:
    """(paths to score, the split line) for `eval --dump`."""
    seen = seen_doc_ids(meta, dump_dir)
    if all_docs:
        return paths, f"split: all {len(paths)} docs of {dump_dir} (--all-docs; training documents included)"
    if seen is None:
        return paths, (
            f"split: all {len(paths)} docs of {dump_dir} (the checkpoint records no training documents; "
            "a checkpoint from `flashmemory train` does)"
        )
    keep = [] if -1 in seen else [p for p in paths if doc_index(p) not in seen]
    return keep, (
        f"split: held-out, {len(keep)} of {len(paths)} docs of {dump_dir} "
        f"(doc ids {[doc_index(p) for p in keep]}; the checkpoint trained/selected on the others)"
    )


def config_split_paths(config_path: str, split: str) -> tuple[list[Path], str]:
    """(paths, split line) of one split of a data config."""
    from flashmemory.train.data_config import load_data_config
    from flashmemory.train.dataset import resolve_docs

    cfg = load_data_config(config_path, require=())
    specs = cfg.split(split)
    if not specs:
        raise ValueError(f"{config_path}: split '{split}' is empty")
    paths = resolve_docs(specs, f"{split} split")
    others: set[str] = set()
    for s in ("train", "val"):
        if s != split and cfg.split(s):
            others |= {str(p.resolve()) for p in resolve_docs(cfg.split(s), f"{s} split")}
    overlap = [p for p in paths if str(p.resolve()) in others]
    note = f"; {len(overlap)} of them also in train/val" if overlap else ""
    return paths, f"split: {split} of {config_path}, {len(paths)} docs{note}"
