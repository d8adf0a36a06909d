"""`eval frontier --recost`: a finished run's HiSparse costs recomputed from its records' own stats (no model runs).

A HiSparse arm's cost fields (`cost.full_index_costs`) follow from what its record stores: the arm's swap-in
misses, prefetched entries and hot-buffer slots, and the document's chunks and prompt length. The shape they need
besides is read back from the record: c4 layers from Full's c4 KV bytes (n_c4 x chunks x 584 B), decode steps from
the arm's replay calls (one per c4 layer and step), index-key bytes from Full's index-key bytes. Every recomputed
field but the H2D must equal the stored one, or the record is refused naming its file and field (its stats and its
costs would not belong together). Other rows' costs do not depend on HiSparse's replay and stay as stored.

Records carry the cost revision their cost fields come from (field cost_rev, `COST_REV`): 2 charges each HiSparse
arm its own misses; a record without the field charged every row the swap-in misses of the last arm replayed, which
is HiSparse+prefetch's wherever that arm ran (plain HiSparse then reads low). Such a record `needs_recost`; one
without a HiSparse+prefetch row was right as written and is left as it is. A recomputed record gets cost_rev and
"recosted": true (its cost fields were recomputed after the sweep; its fingerprint and settings stay those of the
sweep that decoded it, whose quality fields it keeps).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from flashmemory.errors import UserError
from flashmemory.eval.frontier.cost import HISPARSE_ARMS, KV_BYTES, full_index_costs
from flashmemory.eval.records import DOCS_DIR

COST_REV = 2
CHECKED = ("device_bytes", "scored_per_token", "l1_flops_per_token")  # recomputed, must equal the stored values


def needs_recost(rec: dict) -> bool:
    """True when a record's HiSparse H2D may be another arm's: older than COST_REV with a HiSparse+prefetch row."""
    if int(rec.get("cost_rev", 1)) >= COST_REV:
        return False
    return any(HISPARSE_ARMS[1] in rows for rows in rec["budgets"].values())


def _whole(path: Path, field: str, value: float, what: str) -> int:
    """value as a positive integer, or UserError naming the record's field (the stats do not give the shape)."""
    n = round(value)
    if n < 1 or not math.isclose(value, n, rel_tol=1e-9):
        raise UserError(f"{path}: field {field}: gives {value:g} {what}, not a positive whole number; cannot recost")
    return n


def _get(path: Path, row: dict, field: str, key: str) -> float:
    v = row.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise UserError(f"{path}: field {field}.{key}: missing or not a finite number; cannot recost")
    return float(v)


def recost_record(path: Path, rec: dict) -> dict:
    """A copy of `rec` (read from `path`) whose HiSparse arms' cost fields are recomputed from their stored stats,
    with cost_rev = COST_REV and "recosted": True. Arms whose replay was pending (cost_pending) keep their row.
    UserError naming the file and field when a stat is missing or a recomputed field other than the H2D differs
    from the stored one."""
    out = json.loads(json.dumps({k: v for k, v in rec.items() if k != "legacy"}, allow_nan=True))
    n_final = _whole(path, "n_chunks", float(out["n_chunks"]), "chunks")
    P = int(out["prompt_len"])
    for b, rows in out["budgets"].items():
        f = f"budgets.{b}.Full.device_parts"
        parts = rows.get("Full", {}).get("device_parts") or {}
        n_c4 = _whole(path, f, _get(path, parts, f, "c4 kv") / (n_final * KV_BYTES), "c4 layers")
        index_bytes = _whole(path, f, _get(path, parts, f, "index keys") / (n_c4 * n_final), "index-key bytes")
        for arm in HISPARSE_ARMS:
            m = rows.get(arm)
            if m is None or m.get("cost_pending"):
                continue
            field = f"budgets.{b}.{arm}"
            T = _whole(path, f"{field}.calls", _get(path, m, field, "calls") / n_c4, "decode steps")
            n_vis = [min((P + t + 1) // 4, n_final) for t in range(T)]
            new = full_index_costs(
                arm,
                m,
                n_c4=n_c4,
                n_final=n_final,
                n_vis_mean=sum(n_vis) / T,
                n_steps=T,
                index_bytes=index_bytes,
                hot_slots=int(_get(path, m, field, "hot_slots")),
                swap_misses=_get(path, m, field, "misses"),
            )
            stored = m.get("device_parts") if isinstance(m.get("device_parts"), dict) else {}
            checks = [(key, m, key, new[key]) for key in CHECKED]
            checks += [(f"device_parts.{k}", stored, k, v) for k, v in new["device_parts"].items()]
            for name, where, key, value in checks:
                old = _get(path, where, field if where is m else f"{field}.device_parts", key)
                if not math.isclose(value, old, rel_tol=1e-6, abs_tol=1e-9):
                    raise UserError(
                        f"{path}: field {field}.{name}: stored {old:g}, its stats give {value:g}; the record's "
                        "costs do not follow from its stats, so --recost leaves it (rerun the document)"
                    )
            m["h2d_per_token"] = new["h2d_per_token"]
    return out | {"cost_rev": COST_REV, "recosted": True}


def recost_run(out: Path, done: dict[int, dict], log=print) -> int:
    """Rewrite (atomically) every record of `done` (index -> record, read from out/docs) that `needs_recost`,
    updating `done` in place; returns how many were rewritten. All are checked before any is written."""
    from flashmemory.atomic import atomic_write_text

    new = {}
    for i, rec in sorted(done.items()):
        if needs_recost(rec):
            new[i] = recost_record(out / DOCS_DIR / f"{i:05d}.json", rec)
    for i, rec in new.items():
        atomic_write_text(out / DOCS_DIR / f"{i:05d}.json", json.dumps(rec, allow_nan=True))
        done[i] = rec | ({"legacy": True} if done[i].get("legacy") else {})
    log(
        f"[frontier] --recost: {len(new)} of {len(done)} records' HiSparse costs recomputed from their stored "
        f"stats (the rest were current)"
    )
    return len(new)


def check_current(out: Path, done: dict[int, dict]) -> None:
    """UserError naming the first record whose HiSparse costs `needs_recost` (a report would mix them in)."""
    for i, rec in sorted(done.items()):
        if needs_recost(rec):
            raise UserError(
                f"{out / DOCS_DIR / f'{i:05d}.json'}: field cost_rev: its HiSparse rows' H2D bytes took another "
                "arm's swap-in misses; rerun the command with --recost (recomputes them from the records' stats)"
            )
