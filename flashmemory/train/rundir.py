"""A training output dir's run files, and what a run resumed into it keeps of them.

Files a run writes: `ckpt_joint_epoch{E:03d}.pt`, the best checkpoints `ckpt_joint_best_ens_{f1,rk}.safetensors`
(their metadata holds the `step` of the validation that chose them) and `metrics.jsonl`. A run resumed from
epoch E (global step S) continues the run as it stood at that checkpoint, so whatever was written after it (a
longer earlier run, or the part of a killed one after its last checkpoint) is not part of it:

- epoch files past E and best files chosen after step S are moved aside (never deleted);
- `metrics.jsonl` keeps the records up to step S of epoch E (the old file is moved aside whole), so the resumed
  epochs are not logged twice;
- a best file that is absent afterwards (moved aside, or a resume into another dir) is *lost*: its score is
  reset so the resumed run's next validation writes it, and the run always ends with both best files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BEST_F1 = "ckpt_joint_best_ens_f1.safetensors"
BEST_RK = "ckpt_joint_best_ens_rk.safetensors"
BEST_FILES = {"f1": BEST_F1, "rk": BEST_RK}  # key of `Trainer.best` -> file
METRICS = "metrics.jsonl"


def run_files(out: Path) -> list[str]:
    """Names in `out` that a training run writes (and a new run would overwrite or mix with)."""
    if not out.is_dir():
        return []
    return sorted(
        p.name
        for p in out.iterdir()
        if p.is_file()
        and (p.name == METRICS or (p.name.startswith("ckpt_joint_") and p.suffix in (".pt", ".safetensors")))
    )


def epoch_of(name: str) -> int | None:
    """E of a `ckpt_joint_epoch{E:03d}.pt` file name, else None."""
    stem = name.removeprefix("ckpt_joint_epoch").removesuffix(".pt")
    return int(stem) if name.startswith("ckpt_joint_epoch") and name.endswith(".pt") and stem.isdigit() else None


def best_step(path: Path) -> int | None:
    """The training step a best checkpoint was chosen at (its `step` metadata); None if unreadable or absent."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return int((f.metadata() or {})["step"])
    except Exception:  # a truncated file, a foreign one, no step: not provably part of the resumed run
        return None


def _kept(line: str, epoch: int, step: int) -> bool:
    """A metrics.jsonl record from the resumed run up to its checkpoint (a torn last line is not kept)."""
    try:
        rec = json.loads(line)
        return int(rec["step"]) <= step and int(rec.get("epoch", -1)) <= epoch
    except (ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class ResumePlan:
    """What resuming into `out` from (epoch, step) changes there; see the module docstring."""

    move: tuple[str, ...]  # run files to move aside
    metrics: tuple[str, ...] | None  # the metrics.jsonl lines to write back (None: leave metrics.jsonl as is)
    lost_best: tuple[str, ...]  # keys of `BEST_FILES` whose file is absent once `move` is done


def plan_resume(out: Path, epoch: int, step: int) -> ResumePlan:
    names = run_files(out)
    move = [n for n in names if (e := epoch_of(n)) is not None and e > epoch]
    for name in BEST_FILES.values():
        if name in names and ((s := best_step(out / name)) is None or s > step):
            move.append(name)
    metrics = None
    if METRICS in names:
        lines = (out / METRICS).read_text(encoding="utf-8", errors="replace").splitlines()
        kept = tuple(ln for ln in lines if _kept(ln, epoch, step))
        if len(kept) != len(lines):
            metrics = kept
            move.append(METRICS)
    lost = tuple(k for k, name in BEST_FILES.items() if name not in names or name in move)
    return ResumePlan(tuple(move), metrics, lost)


def read_progress(obj: dict, path: str | Path, best: dict) -> tuple[int, int, dict]:
    """(step, epoch, best) of an epoch checkpoint, checked where they are read: step and epoch non-negative
    integers, best scores finite or -1 (unset), `stale` a count. A NaN or a string there would reach `int()`
    or be compared as a score (a CheckpointError naming the file and the field)."""
    import math

    from flashmemory.retriever.checkpoint import CheckpointError

    def number(key: str, v: object, integer: bool) -> float:
        x = v.item() if hasattr(v, "item") else v
        ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        if not ok or (integer and (x != int(x) or x < 0)):
            kind = "a non-negative integer" if integer else "a finite number"
            raise CheckpointError(
                f"--resume-from {path}: '{key}' is {x!r}, not {kind}; not an epoch checkpoint "
                "written by `flashmemory train`?"
            )
        return int(x) if integer else float(x)

    step, epoch = number("step", obj["step"], True), number("epoch", obj["epoch"], True)
    saved = obj.get("best", best)
    if not isinstance(saved, dict):
        raise CheckpointError(f"--resume-from {path}: 'best' is not a dict of scores")
    out = {k: number(f"best.{k}", v, k == "stale") for k, v in saved.items()}
    return step, epoch, best | out
