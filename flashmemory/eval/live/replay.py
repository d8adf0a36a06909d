"""The replay side of a live run: the replay frontier's rows for the same documents, and the replay's tokens.

`replay_rows` reads a replay frontier's per-document records (`eval frontier --out DIR`: DIR/docs/<i>.json): for
each live arm the row of the same method at the same budget (stock -> Full). `replay_config` reads the settings the
replay ran with (DIR/frontier.json), so the report names any that differ from the live run's.

`ReplayTokens` recomputes the replay's greedy tokens for a document with the project's engine (`eval.frontier.run
.Sweep`, the shipped trained model, FlashMemory alone at the live budgets): Full's free-running greedy tokens and
FlashMemory's tokens as the replay scores them (teacher-forced on Full's response: equal to a free-running decode up
to the first token where it departs from Full). HiSparse is exact in the replay, so its tokens are Full's. They are
cached per document under out/replay/<i>.json, keyed by the replay's settings fingerprint and the document; their
task scores are checked against the replay frontier's records of the same documents (`ReplayTokens.check`).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from flashmemory.errors import UserError
from flashmemory.eval.budgets import budget_key
from flashmemory.eval.live.arms import REPLAY_ROW, LiveArm

REPLAY_DIR = "replay"


def replay_row(rec: dict, arm: LiveArm) -> dict | None:
    """The replay record's row for `arm` (stock: Full at the record's first budget), None when it has none."""
    budgets = rec.get("budgets") or {}
    if arm.budget is None:
        rows = next(iter(budgets.values()), {})
    else:
        rows = budgets.get(budget_key(arm.budget)) or {}
    row = rows.get(REPLAY_ROW[arm.kind])
    return row if isinstance(row, dict) else None


def replay_rows(replay: str, arms: tuple[LiveArm, ...], indices: list[int]) -> dict[str, dict[int, dict]]:
    """{arm key: {document index: replay row}} for the documents the replay has; {} for replay == ""."""
    if not replay:
        return {}
    d = Path(replay) / "docs"
    if not d.is_dir():
        raise UserError(f"--replay {replay}: no replay frontier run there (no {d})")
    out: dict[str, dict[int, dict]] = {a.key: {} for a in arms}
    for i in indices:
        p = d / f"{i:05d}.json"
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise UserError(f"--replay {replay}: {p} cannot be read ({e})") from None
        for a in arms:
            row = replay_row(rec, a)
            if row is not None and isinstance(row.get("task_score"), (int, float)):
                out[a.key][i] = row
    return out


REPLAY_KEYS = ("doc_len", "gen_tokens", "tau", "threshold", "tail_chunks", "first_doc", "seed", "tasks")
DOC_KEYS = ("doc_len", "gen_tokens", "seed", "tasks")  # settings that make document i another document


def topk_notes(replay: str, done: dict[str, dict[int, dict]]) -> list[str]:
    """A line naming the index top-k of each side when they differ (the served model's against the replay's)."""
    live = {r["settings"].get("top_k") for recs in done.values() for r in recs.values() if "top_k" in r["settings"]}
    p = next(iter(sorted((Path(replay) / "docs").glob("*.json"))), None) if replay else None
    if p is None or not live:
        return []
    try:
        rk = json.loads(p.read_text(encoding="utf-8")).get("index_topk")
    except (OSError, ValueError):
        return []
    if rk is None or live == {rk}:
        return []
    return [f"Index top-k: live {', '.join(map(str, sorted(live)))} (the served model's), replay {rk}"]


def replay_config(replay: str) -> dict:
    """The replay frontier's settings (its frontier.json "config"), {} when it has no frontier.json."""
    p = Path(replay) / "frontier.json"
    if not replay or not p.is_file():
        return {}
    try:
        cfg = json.loads(p.read_text(encoding="utf-8")).get("config") or {}
    except (OSError, ValueError) as e:
        raise UserError(f"--replay {replay}: {p} cannot be read ({e})") from None
    return {k: cfg[k] for k in REPLAY_KEYS if k in cfg}


def setting_differences(live: dict, replay: dict) -> list[str]:
    """'name: live X, replay Y' for every document or Level-1 setting the two runs do not share."""
    out = []
    for k in REPLAY_KEYS:
        if k in replay and k in live and list_or(live[k]) != list_or(replay[k]):
            out.append(f"{k}: live {live[k]}, replay {replay[k]}")
    return out


def list_or(v):
    return list(v) if isinstance(v, (list, tuple)) else v


class ReplayTokens:
    """The replay's tokens of one document per live arm (`tokens(doc)`), computed once and cached in out/replay."""

    def __init__(self, out: Path, retriever: str, budgets: tuple[float, ...], cfg, log=print):
        self.out, self.retriever, self.budgets, self.cfg, self.log = out, retriever, budgets, cfg, log
        self._sweep = None
        self._fp: str | None = None
        self.scores: dict[int, dict[str, float]] = {}  # document -> the replay's task score per arm key

    def _frontier_config(self):
        from flashmemory.eval.frontier.run import FrontierConfig

        c = self.cfg
        return FrontierConfig(
            out_dir=str(self.out / REPLAY_DIR),
            retriever=self.retriever,
            n_per_task=1,
            budgets=self.budgets,
            methods=("FlashMemory",),
            tasks=c.tasks,
            doc_len=c.doc_len,
            gen_tokens=c.gen_tokens,
            tau=c.tau,
            tail_chunks=c.tail_chunks,
            threshold=c.threshold,
            first_doc=c.first_doc,
            seed=c.seed,
        )

    def fingerprint(self) -> str:
        if self._fp is None:
            from flashmemory.eval.frontier.identity import fingerprint_of, settings

            s = settings(self._frontier_config())
            plan = getattr(self.cfg, "replay_first_plan", "prompt")
            self._fp = fingerprint_of(s if plan == "prompt" else {**s, "first_plan": plan})
        return self._fp

    def tokens(self, index: int, task: str, doc_digest: str) -> dict[str, list[int]]:
        """{"Full": ids, "FlashMemory@<b>": ids, ...} of document `index` (computed on first ask)."""
        from flashmemory.atomic import atomic_write_text

        path = self.out / REPLAY_DIR / f"{index:05d}.json"
        fp = self.fingerprint()
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
            if rec.get("fingerprint") == fp and rec.get("doc") == doc_digest:
                self.scores[index] = rec.get("task_score") or {}
                return rec["tokens"]
        except (OSError, ValueError, AttributeError):
            pass
        toks, scores = self._compute(index, task)
        rec = {"fingerprint": fp, "doc": doc_digest, "index": index, "tokens": toks, "task_score": scores}
        atomic_write_text(path, json.dumps(rec))
        self.scores[index] = scores
        return toks

    def check(self, replay: dict[str, dict[int, dict]]) -> list[str]:
        """A line for every document whose recomputed replay score is not the replay run's record (the replay
        engine or its settings changed since that run: its tokens would not be the ones scored there)."""
        out = []
        for i, sc in sorted(self.scores.items()):
            for arm, rows in replay.items():
                ref = "Full" if arm == "stock" else arm if arm.startswith("FlashMemory") else None
                if ref in sc and i in rows and abs(float(rows[i]["task_score"]) - sc[ref]) > 1e-9:
                    out.append(
                        f"Replay tokens of document {i} score {sc[ref]:.3f} as {ref}; the replay run's record "
                        f"{float(rows[i]['task_score']):.3f} ({arm}): the replay engine changed since that run"
                    )
        return out

    def _compute(self, index: int, task: str) -> tuple[dict[str, list[int]], dict[str, float]]:
        """Run the replay for one document, keeping the token lists each method's score was computed from."""
        from flashmemory.eval.frontier.run import Sweep

        if self._sweep is None:
            self.log("[live] loading the replay engine (the shipped trained model) for the replay's tokens ...")
            self._sweep = _CapturingSweep(self._frontier_config())
            plan = getattr(self.cfg, "replay_first_plan", "prompt")  # how the replay starts a request (live's mode)
            self._sweep.hc = replace(self._sweep.hc, first_plan=plan)
        sw = self._sweep
        sw.seen.clear()
        body = Sweep.doc(sw, index, task)
        names = ["Full"] + [f"FlashMemory@{budget_key(b)}" for b in self.budgets]
        if len(sw.seen) != len(names):
            raise RuntimeError(f"replay tokens: {len(sw.seen)} scored token lists for {len(names)} rows")
        toks = dict(zip(names, sw.seen))
        scores = {"Full": float(body["budgets"][budget_key(self.budgets[0])]["Full"]["task_score"])}
        for b in self.budgets:
            scores[f"FlashMemory@{budget_key(b)}"] = float(body["budgets"][budget_key(b)]["FlashMemory"]["task_score"])
        return toks, scores


def _capturing_sweep_class():
    from flashmemory.eval.frontier.run import Sweep

    class CapturingSweep(Sweep):
        """The frontier's Sweep, keeping every token list it turns into text for scoring, in call order (Full
        first, then each budget's methods)."""

        def __init__(self, fc):
            super().__init__(fc)
            self.seen: list[list[int]] = []

        def text(self, ids: list[int]) -> str:
            self.seen.append([int(i) for i in ids])
            return super().text(ids)

    return CapturingSweep


def _CapturingSweep(fc):  # noqa: N802 - a class made on first use (the frontier package loads torch models)
    return _capturing_sweep_class()(fc)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length if one is a prefix of the
    other), None when equal."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
