"""The live run: a plan of documents (the replay frontier's: document i is task tasks[i % len(tasks)] with seed
seed x 1000 + i, i from `first_doc` on), every arm's stack in turn, one record per (arm, document).

Records: `out/docs/<arm>/<i>.json`, written atomically as each document finishes, each carrying its fingerprint: the
sha256 of everything its numbers depend on, by content (the served model's config, weights and tokenizer files, the
arm's server settings, the extra server environment, the decode length, and the document itself: its prompt ids,
answers and task). A rerun skips every document whose record has its fingerprint, redoes a record that does not
parse (a torn write), and stops, naming the file, at a record of another configuration (use another --out, or
`replace` to run that document again and overwrite it). The output dir is locked (`flashmemory.outdir.DirLock`) and
marked as `eval live`'s.

Gauges: D's gauges (resident fraction, reserve use) describe the requests live when they are read, and after a
document none is, so they are sampled on a thread while the document decodes (`GaugeSampler`); a record keeps their
mean over the samples taken with a request live (`gauges_live`) beside the counters' deltas (`metrics`).

Chunks: `max_docs` caps the new documents per arm in one invocation; a stack hands the live lock back after
`hold_s` seconds (it is stopped and started again for the arm's remaining documents), so other users of the
machine's live servers get their turn. The report (`eval.live.report`) is rewritten from every finished record at
the end of each invocation.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flashmemory.errors import UserError
from flashmemory.eval.live.arms import LiveArm

FORMAT = "flashmemory-live/1"
KIND = "eval live"
DOCS_DIR = "docs"
DEFAULT_TASKS = ("niah_single", "niah_multikey", "mqar")  # the trained model's tasks, as the replay frontier's


@dataclass(frozen=True)
class LiveConfig:
    """One live run. model: the served checkpoint dir; retriever: Level 1's checkpoint for the FlashMemory and
    HiSparse+prefetch arms; server_env: extra environment for P and D (e.g. a CPU-layer row's gate); the document
    settings (tasks, doc_len, gen_tokens, first_doc, seed) and Level 1's (tau, threshold, tail_chunks) are the
    replay frontier's defaults; replay: the replay frontier's output dir set beside the live numbers ("" = none)."""

    out_dir: str
    model: str
    arms: tuple[LiveArm, ...]
    retriever: str = ""
    tokenizer: str = "tiny"
    n_per_task: int = 8
    tasks: tuple[str, ...] = DEFAULT_TASKS
    doc_len: int = 4096
    gen_tokens: int = 24
    tau: int = 16
    threshold: float = 0.5
    tail_chunks: int = 8
    first_doc: int = 8
    seed: int = 0
    server_env: tuple[tuple[str, str], ...] = ()
    replay: str = ""
    replay_retriever: str = ""  # the replay's retriever, to recompute its tokens (`eval.live.replay.ReplayTokens`)
    replay_tokens: bool = False
    replay_first_plan: str = "prompt"  # how the recomputed replay starts a request (`eval.replay.FIRST_PLANS`)
    lock: str = "/tmp/fm-live.lock"
    hold_s: float = 600.0
    max_docs: int | None = None
    replace: bool = False  # a record of another configuration is run again and overwritten (else: stop)
    c4_mode: str = "copy"  # FlashMemory's Path-P mode on D (`arms.C4_MODES`)
    startup_timeout: float = 420.0
    logs: str = ""  # server logs ("" = out/logs)
    budgets: tuple[float, ...] = field(default=(0.1, 0.2))

    def context_len(self) -> int:
        """Both servers' --context-length: the prompt, the decode and one spare 1K block, in 1K blocks."""
        return -(-(self.doc_len + self.gen_tokens + 1024) // 1024) * 1024


@dataclass(frozen=True)
class LiveDoc:
    """One planned document: its index, task, the task item, the prompt ids, the prompt text sent, its digest."""

    index: int
    task: str
    item: object  # flashmemory.tasks.suite.TaskItem
    prompt_ids: list[int]
    prompt: str
    digest: str


def plan(cfg: LiveConfig) -> list[tuple[int, str]]:
    """[(document index, task)]: n_per_task documents of each task, tasks cycling from index first_doc (the replay
    frontier's `doc_plan`)."""
    return [
        (cfg.first_doc + j, cfg.tasks[(cfg.first_doc + j) % len(cfg.tasks)])
        for j in range(cfg.n_per_task * len(cfg.tasks))
    ]


def make_doc(cfg: LiveConfig, i: int, task: str, tok) -> LiveDoc:
    """Document i of `task` as the replay frontier builds it, and its prompt as text (the task tokenizer's decode of
    the chat prompt's ids, which the served tokenizer maps back to the same ids)."""
    from flashmemory.tasks.suite import generate

    it = generate(task, cfg.doc_len, n=1, seed=cfg.seed * 1000 + i, tokenizer=tok)[0]
    ids = tok.encode_chat(it.messages)
    body = json.dumps({"task": task, "ids": ids, "answers": it.answers, "meta": it.meta}, sort_keys=True, default=str)
    return LiveDoc(i, task, it, ids, tok.decode(ids), hashlib.sha256(body.encode()).hexdigest())


def decode_ids(tok, ids: list[int]) -> str:
    """Output ids as the task tokenizer's text; ids outside its vocabulary (the served tokenizer's parked special
    tokens) read as its unknown token."""
    return tok.decode([i if 0 <= i < tok.vocab_size else tok.unk for i in ids])


def served_model_digest(model: str) -> str:
    """The served model by content: `eval.frontier.identity.model_digest` (config and weights) and the sha256 of
    its tokenizer files (what turns the text prompt back into ids)."""
    from flashmemory.eval.frontier.identity import model_digest
    from flashmemory.eval.records import file_digest

    h = hashlib.sha256(model_digest(model, "--model").encode())
    for f in sorted(Path(model).glob("tokenizer*.json")):
        h.update(f"{f.name}\0{file_digest(str(f), '--model')}\0".encode())
    return h.hexdigest()


def arm_settings(cfg: LiveConfig, arm: LiveArm, model_digest: str, retriever_digest: str, topk: int) -> dict:
    """Everything an arm's records depend on but the document (JSON-ready)."""
    s = arm.settings(cfg.doc_len, topk, cfg.tau, cfg.threshold, cfg.tail_chunks, cfg.c4_mode)
    uses_l1 = arm.kind in ("FlashMemory", "HiSparse+prefetch")
    return {
        "arm": arm.key,
        "model": model_digest,
        "retriever": retriever_digest if uses_l1 else "",
        "server_env": dict(cfg.server_env),
        "gen_tokens": cfg.gen_tokens,
        "context_len": cfg.context_len(),
        **s,
    }


def record_fingerprint(settings: dict, doc_digest: str) -> str:
    """sha256 (16 hex) of an arm's settings and one document's content."""
    body = json.dumps({"scheme": 1, "settings": settings, "doc": doc_digest}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def record_path(out: Path, arm: LiveArm, i: int) -> Path:
    return out / DOCS_DIR / arm.key / f"{i:05d}.json"


def read_done(path: Path, fp: str, replace: bool = False) -> dict | None:
    """The finished record at `path` when it is this configuration's; None when missing or torn (redone), or of
    another configuration with `replace`; UserError naming the file and field for another command's, another
    configuration's (without `replace`) or an unreadable body."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        got = rec.get("format") if isinstance(rec, dict) else type(rec).__name__
        raise UserError(f"{path}: field format is {got!r}, not {FORMAT!r}: not a record of `flashmemory eval live`")
    if rec.get("fingerprint") != fp:
        if replace:
            return None
        raise UserError(
            f"{path}: written with another configuration (fingerprint {rec.get('fingerprint')}, this run {fp}: another "
            "model, arm setting, server environment or document); use another --out, or --replace to run it again"
        )
    for f, kind in (("output_ids", list), ("task_score", (int, float)), ("seconds", (int, float))):
        if not isinstance(rec.get(f), kind) or isinstance(rec.get(f), bool):
            raise UserError(f"{path}: field {f} missing or of the wrong type; not a finished record")
    return rec


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before of the counters (`*_total`), the gauges as read after (a document's costs, D serving one
    request at a time)."""
    out = {}
    for k, v in after.items():
        out[k] = v - before.get(k, 0.0) if k.endswith("_total") else v
    return out


LIVE_GAUGE = "flashmemory_live_requests"  # FlashMemory's gauge of live requests on D


class GaugeSampler:
    """`read()` (D's /metrics as {name: value}) every `period` s on its own thread while a document runs (`with`);
    `means()`: each gauge's mean over the samples taken while a request was live (`LIVE_GAUGE` > 0), {} when none
    was (stock and HiSparse arms export no FlashMemory gauges). A failed read is skipped."""

    def __init__(self, read: Callable[[], dict[str, float]], period: float = 1.0):
        self.read, self.period = read, period
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GaugeSampler:
        self._thread = threading.Thread(target=self._loop, name="live-gauges", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                m = self.read()
            except Exception:  # noqa: BLE001 - a sample lost; the counters are read apart
                continue
            if m.get(LIVE_GAUGE, 0.0) > 0:
                self.samples.append({k: v for k, v in m.items() if not k.endswith("_total")})

    def means(self) -> dict[str, float]:
        keys = sorted({k for s in self.samples for k in s})
        return {k: sum(s[k] for s in self.samples if k in s) / sum(k in s for s in self.samples) for k in keys}


Opener = Callable[[LiveArm], object]  # arm -> a session with complete(prompt, n), metrics(), held_s(), close()


def run_live(cfg: LiveConfig, opener: Opener, log=print, report: bool = True) -> dict[str, dict[int, dict]]:
    """Run (or continue) every arm of `cfg` in cfg.out_dir with stacks from `opener`; write the report. Returns
    {arm key: {document index: record}} of the finished records."""
    from flashmemory.outdir import DirLock, claim_kind, prepare_dir

    out = prepare_dir(cfg.out_dir, "--out")
    with DirLock(out, "live output directory"):
        claim_kind(out, KIND, "--out", KIND if (out / DOCS_DIR).is_dir() else None)
        done = _run(cfg, out, opener, log)
        if report:
            from flashmemory.eval.live.report import write_report

            write_report(cfg, out, done, log)
        return done


def _identity(cfg: LiveConfig) -> tuple[str, str, int]:
    from flashmemory.eval.records import file_digest

    cfg_path = Path(cfg.model) / "config.json"
    try:
        topk = int(json.loads(cfg_path.read_text(encoding="utf-8")).get("index_topk", 512))
    except (OSError, ValueError) as e:
        raise UserError(f"--model {cfg.model}: cannot read {cfg_path} ({e})") from None
    needs_l1 = any(a.kind in ("FlashMemory", "HiSparse+prefetch") for a in cfg.arms)
    if needs_l1 and not cfg.retriever:
        raise UserError("--retriever: the FlashMemory and HiSparse+prefetch arms need a Level-1 checkpoint")
    rdig = "sha256:" + file_digest(cfg.retriever, "--retriever") if cfg.retriever else ""
    return served_model_digest(cfg.model), rdig, topk


def _run(cfg: LiveConfig, out: Path, opener: Opener, log) -> dict[str, dict[int, dict]]:
    from flashmemory.atomic import atomic_write_text
    from flashmemory.tasks.suite import score
    from flashmemory.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer)
    mdig, rdig, topk = _identity(cfg)
    docs = [make_doc(cfg, i, t, tok) for i, t in plan(cfg)]
    result: dict[str, dict[int, dict]] = {}
    for arm in cfg.arms:
        st = arm_settings(cfg, arm, mdig, rdig, topk)
        fps = {d.index: record_fingerprint(st, d.digest) for d in docs}
        done = {
            d.index: r
            for d in docs
            if (r := read_done(record_path(out, arm, d.index), fps[d.index], cfg.replace)) is not None
        }
        todo = [d for d in docs if d.index not in done]
        if cfg.max_docs is not None:
            todo = todo[: cfg.max_docs]
        log(f"[live] {arm.key}: {len(docs)} documents planned, {len(done)} done earlier, {len(todo)} to run now")
        result[arm.key] = done
        if not todo:
            continue
        session, last_s = None, 0.0
        try:
            for n, d in enumerate(todo, 1):
                if session is not None and session.held_s() + last_s > cfg.hold_s:
                    log(f"[live] {arm.key}: handing the live lock back after {session.held_s():.0f} s; restarting")
                    session.close()
                    session = None
                if session is None:
                    session = opener(arm)
                t0 = time.perf_counter()
                before = session.metrics()
                with GaugeSampler(lambda s=session: s.metrics(settle_s=0.0)) as gauges:
                    c = session.complete(d.prompt, cfg.gen_tokens)
                after = session.metrics()
                text = decode_ids(tok, c.output_ids)
                rec = {
                    "format": FORMAT,
                    "fingerprint": fps[d.index],
                    "settings": st,
                    "arm": arm.key,
                    "index": d.index,
                    "task": d.task,
                    "doc": d.digest,
                    "prompt_len": len(d.prompt_ids),
                    "prompt_ids_equal": c.prompt_ids == d.prompt_ids,
                    "output_ids": c.output_ids,
                    "text": text,
                    "task_score": float(score(d.item, text)),
                    "seconds": time.perf_counter() - t0,
                    "metrics": counter_delta(before, after),
                    "gauges_live": gauges.means(),
                }
                atomic_write_text(record_path(out, arm, d.index), json.dumps(rec))
                done[d.index] = rec
                last_s = rec["seconds"]
                log(
                    f"[live] {arm.key}: document {d.index} ({d.task}) {n}/{len(todo)}: score {rec['task_score']:.3f}, "
                    f"{last_s:.0f} s"
                    + ("" if rec["prompt_ids_equal"] else " (the server tokenized the prompt differently)")
                )
        finally:
            if session is not None:
                session.close()
    return result
