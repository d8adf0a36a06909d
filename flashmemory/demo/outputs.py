"""What `flashmemory demo` may do to its `--out-dir`: the outputs it writes (`OUTPUTS`), the sha256 manifest of
the ones it wrote last (`OUTPUTS_MANIFEST`) so a rerun replaces its own files and moves anything else aside to a
`.bak-<UTC time>` name without ever overwriting a backup, and the `work/` folder it deletes only when its
`WORK_MARKER` says the demo wrote it. The output dir is locked by the caller (`flashmemory.demo.pipeline`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

from flashmemory.atomic import file_sha256
from flashmemory.demo.config import WORK_MARKER
from flashmemory.errors import UserError

OUTPUTS = ("tasks.jsonl", "results.json", "report.md", "coverage.png")  # what a run writes into --out-dir
OUTPUTS_MANIFEST = ".flashmemory-demo-outputs.json"  # {name: sha256} of the outputs the demo itself wrote last


def _own_outputs(out: Path) -> dict[str, str]:
    try:
        own = json.loads((out / OUTPUTS_MANIFEST).read_text())
        return {str(k): str(v) for k, v in own.items()} if isinstance(own, dict) else {}
    except (OSError, ValueError):
        return {}


def record_outputs(out: Path, names: tuple[str, ...]) -> None:
    """Note the sha256 of outputs the demo just wrote, so its next run knows them as its own (and replaces them)."""
    from flashmemory.atomic import atomic_write_text

    own = _own_outputs(out) | {n: file_sha256(out / n) for n in names if (out / n).is_file()}
    atomic_write_text(out / OUTPUTS_MANIFEST, json.dumps(own, indent=1, sort_keys=True))


def _move_no_replace(src: Path, dest: Path) -> None:
    """Rename `src` to `dest`; FileExistsError if `dest` exists. A file goes by hard link + unlink, which cannot
    replace an existing backup (a rename could); a directory, or a file system without hard links, by a
    rename after checking `dest` is free (the output dir is locked, so nothing of ours races it)."""
    if not src.is_dir() or src.is_symlink():
        try:
            os.link(src, dest, follow_symlinks=False)
            os.unlink(src)
            return
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(dest)
    os.rename(src, dest)


def move_aside_outputs(out: Path, names: tuple[str, ...], log=print) -> list[tuple[str, str]]:
    """Before a run writes `names` into `out`: move each existing one aside to `name.bak-<UTC time>[-n]` (never
    onto an existing backup), unless it is byte for byte what the demo itself wrote last (`OUTPUTS_MANIFEST`).
    Says so in one line; returns [(name, backup name)]."""
    own = _own_outputs(out)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    moved = []
    for name in names:
        p = out / name
        if not (p.exists() or p.is_symlink()):
            continue
        if p.is_file() and not p.is_symlink() and own.get(name) == file_sha256(p):
            continue  # the demo's own output of its last run
        n = 1
        while True:
            dest = out / (f"{name}.bak-{stamp}" + (f"-{n}" if n > 1 else ""))
            try:
                _move_no_replace(p, dest)
                break
            except FileExistsError:
                n += 1
        moved.append((name, dest.name))
    if moved:
        log(
            f"[demo] moved earlier files the demo would overwrite aside in {out}: "
            + ", ".join(f"{a} -> {b}" for a, b in moved)
        )
    return moved


def clean_work_dir(out: Path) -> None:
    """Remove `out/work` from an earlier demo run (stale documents would mix two configurations), but only if
    the demo wrote it (it holds WORK_MARKER); anything else there is the user's, and the demo refuses."""
    work = out / "work"
    if work.exists():
        if not (work / WORK_MARKER).is_file():
            raise UserError(
                f"--out-dir {out}: {work} exists and was not written by the demo; move it away or "
                "choose another --out-dir (the demo deletes only its own work folder)"
            )
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / WORK_MARKER).write_text("written by `flashmemory demo`; removed by its next run in this folder\n")
