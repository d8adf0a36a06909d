"""Training data configs: which dump directories (and which docs in them) form train / val / test.

A config is a JSON or YAML file:

    {"train": [{"data_dir": "dump_a", "doc_ids": [0, 1, 2]}, {"data_dir": "/abs/dump_b", "doc_ids": null}],
     "val":   [{"data_dir": "dump_a", "doc_ids": [3]}],
     "test":  [...]}

Relative `data_dir`s resolve against the config file's directory, so a config travels with its
dumps. `doc_ids: null` (or absent) means every doc in the directory. Every problem is a
`DataConfigError` that names the file, the split and the entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flashmemory.errors import UserError

SPLITS = ("train", "val", "test")


class DataConfigError(UserError):
    """A data config file is unreadable, malformed, or names data that does not exist."""


@dataclass(frozen=True)
class DataSpec:
    """One dump directory and an optional whitelist of doc indices (None = all docs)."""

    data_dir: Path
    doc_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DataConfig:
    path: Path
    train: tuple[DataSpec, ...]
    val: tuple[DataSpec, ...]
    test: tuple[DataSpec, ...]

    def split(self, name: str) -> tuple[DataSpec, ...]:
        if name not in SPLITS:
            raise KeyError(f"unknown split {name!r} (use one of {SPLITS})")
        return getattr(self, name)


def _read(path: Path) -> object:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise DataConfigError(f"{path}: invalid YAML: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def _spec(path: Path, split: str, i: int, raw: object, check_exists: bool) -> DataSpec:
    where = f"{path}: {split}[{i}]"
    if isinstance(raw, str):
        raw = {"data_dir": raw}
    if not isinstance(raw, dict):
        raise DataConfigError(f"{where}: expected an object with 'data_dir' (and optional 'doc_ids'), got {raw!r}")
    unknown = set(raw) - {"data_dir", "doc_ids"}
    if unknown:
        raise DataConfigError(f"{where}: unknown key(s) {sorted(unknown)} (allowed: data_dir, doc_ids)")
    d = raw.get("data_dir")
    if not isinstance(d, str) or not d:
        raise DataConfigError(f"{where}: 'data_dir' must be a non-empty string, got {d!r}")
    data_dir = Path(d).expanduser()
    if not data_dir.is_absolute():
        data_dir = (path.parent / data_dir).resolve()
    if check_exists and not data_dir.is_dir():
        raise DataConfigError(
            f"{where}: data_dir {d!r} -> {data_dir} is not a directory "
            "(relative paths resolve against the config file's directory)"
        )
    ids = raw.get("doc_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
            raise DataConfigError(f"{where}: 'doc_ids' must be null or a list of non-negative integers")
        ids = tuple(sorted(set(ids)))
    return DataSpec(data_dir, ids)


def load_data_config(
    path: str | Path,
    check_exists: bool = True,
    require: tuple[str, ...] = ("train", "val"),
) -> DataConfig:
    """Parse and validate a data config. `require`: splits that must name at least one directory."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise DataConfigError(f"data config {path}: no such file")
    raw = _read(p)
    if not isinstance(raw, dict):
        raise DataConfigError(f"{p}: top level must be an object with keys {SPLITS}")
    unknown = set(raw) - set(SPLITS)
    if unknown:
        raise DataConfigError(f"{p}: unknown split(s) {sorted(unknown)} (allowed: {', '.join(SPLITS)})")
    out: dict[str, tuple[DataSpec, ...]] = {}
    for split in SPLITS:
        entries = raw.get(split) or []
        if not isinstance(entries, list):
            raise DataConfigError(f"{p}: '{split}' must be a list of {{data_dir, doc_ids}} objects")
        out[split] = tuple(_spec(p, split, i, e, check_exists) for i, e in enumerate(entries))
    for split in require:
        if not out[split]:
            raise DataConfigError(f"{p}: split '{split}' is empty; it needs at least one data_dir")
    return DataConfig(path=p, **out)


def trained_on_meta(train_specs, val_specs) -> str:
    """The `trained_on` checkpoint metadata (read by `flashmemory.eval.split`) for the DataSpecs of the train and val
    splits: {"train"|"val": [[absolute data_dir, doc ids or null], ...]} as JSON."""

    def enc(specs):
        return [[str(Path(s.data_dir).resolve()), None if s.doc_ids is None else list(s.doc_ids)] for s in specs]

    return json.dumps({"train": enc(train_specs), "val": enc(val_specs)})
