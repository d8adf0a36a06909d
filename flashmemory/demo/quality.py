"""`flashmemory eval quality`: the demo's quality table at a size that means something, resumable.

The same pipeline as `flashmemory demo` stages 1-5 (`flashmemory.demo.pipeline`), on the shipped trained model:
the demo's retriever (trained on the demo's 6 train / 2 val documents, picked on val) is trained once per output
dir (or given with --retriever), then held-out documents -- the demo's test documents continued: document i is
`tasks[i % len(tasks)]` with seed `seed * 1000 + i`, i from n_train + n_val on, so the demo's 9 test documents are
the first 9 here -- are each decoded under Full attention and replayed with every method at every budget
(`eval.harness.evaluate_doc`, Level-2 task score included).

Resumable: each document's result is written atomically to `out/docs/<i>.json` as soon as it is done (with the
run's fingerprint); a rerun of the same command skips the documents already there and continues, and a larger
--n-per-task extends the run. A document file from another configuration stops the run (one line naming it).
The output dir is locked against a second writer (`flashmemory.outdir.DirLock`) and marked as a quality run's (an
`eval frontier` dir is refused, and the reverse: `eval.records.claim_run_dir`). At the end (and with
--report-only at any time) `results.json` and `report.md` aggregate every finished document, each cell with its n
and a 95% interval (`eval.intervals`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from flashmemory.errors import UserError
from flashmemory.eval.budgets import check_distinct
from flashmemory.eval.records import (
    DOCS_DIR,
    check_n_per_task,
    check_tasks,
    claim_run_dir,
    file_digest,
    load_records,
)

RETRIEVER_DONE = "retriever.json"  # written once the run's retriever is trained (its path and summary)
FORMAT = "flashmemory-quality/1"


@dataclass(frozen=True)
class QualityConfig:
    """One quality run. n_per_task: held-out documents per task (the fingerprint leaves it out: a larger value
    extends a run); budgets: KMAX fractions in (0, 1]; methods: `eval.methods.METHODS` names (Full always runs);
    tasks: () = the demo's (the trained model's) tasks, else a subset of them (the documents of the other tasks
    are skipped, so document i is the same document in every run); tau: 0 = the demo's; retriever: a checkpoint
    to use instead of training the demo's."""

    out_dir: str = "quality_out"
    n_per_task: int = 48
    budgets: tuple[float, ...] = (0.1, 0.2)
    methods: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    tau: int = 0
    seed: int = 0
    retriever: str = ""

    def __post_init__(self) -> None:
        from flashmemory.eval.methods import METHODS

        check_n_per_task(self.n_per_task)
        if not self.budgets or any(not 0.0 < b <= 1.0 for b in self.budgets):
            raise UserError(f"--budgets {','.join(map(str, self.budgets))}: each must lie in (0, 1]")
        check_distinct(self.budgets)
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise UserError(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(METHODS)}")
        if self.tau < 0:
            raise UserError(f"--tau {self.tau}: must be >= 1 (0 = the demo's)")
        if not 0 <= self.seed < 2**20:  # document seeds are seed * 1000 + i
            raise UserError(f"--seed {self.seed}: must lie in [0, 2**20)")


def demo_config(qc: QualityConfig):
    """The demo configuration the run reuses (the shipped trained model's settings); UserError without it."""
    from flashmemory.demo.config import DemoConfig, resolve_model

    cfg, note = resolve_model(DemoConfig(out_dir=qc.out_dir, seed=qc.seed, plot=False))
    if "RANDOM" in note:
        raise UserError(
            "flashmemory eval quality: the shipped trained model (flashmemory/hf/trained/dsv4-retrieval) "
            "is missing; quality numbers on random weights mean nothing"
        )
    check_tasks(qc.tasks, cfg.tasks, "the trained model's")
    return (replace(cfg, tau=qc.tau) if qc.tau else cfg), note


def doc_plan(n_first: int, tasks: tuple[str, ...], keep: tuple[str, ...], n_per_task: int) -> list[tuple[int, str]]:
    """[(document index i, task)]: i = n_first, n_first + 1, ... with task tasks[i % len(tasks)], keeping the
    tasks in `keep` (all when empty), until each kept task has n_per_task documents."""
    want = keep or tasks
    count = {t: 0 for t in want}
    out, i = [], n_first
    while any(c < n_per_task for c in count.values()):
        t = tasks[i % len(tasks)]
        if t in count and count[t] < n_per_task:
            out.append((i, t))
            count[t] += 1
        i += 1
    return out


def fingerprint(cfg_dict: dict, qc: QualityConfig, methods: tuple[str, ...]) -> str:
    """sha256 (16 hex) of everything a document's numbers depend on (not n_per_task, out_dir or the task filter)."""
    keep = {k: v for k, v in cfg_dict.items() if k not in ("out_dir", "plot", "n_test", "serve")}
    keep["model"] = Path(str(keep.get("model", ""))).name  # the shipped model's name, not this checkout's path
    key = {
        "demo": keep,
        "budgets": list(qc.budgets),
        "methods": list(methods),
        "retriever": file_digest(qc.retriever, "--retriever") if qc.retriever else "",
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_done(out: Path, fp: str, budgets: tuple[float, ...] | None = None) -> dict[int, dict]:
    """{document index: record} of the finished documents under out/docs (`eval.records`); budgets: the run's,
    which every record must hold exactly (None: any)."""
    keys = tuple(str(b) for b in budgets) if budgets is not None else None
    return load_records(out, fp, FORMAT, "a quality run", "--out-dir", keys)


def write_doc(out: Path, rec: dict) -> Path:
    """Atomically write one finished document's record (temp file + fsync + rename)."""
    from flashmemory.atomic import atomic_write_text

    return atomic_write_text(out / DOCS_DIR / f"{rec['index']:05d}.json", json.dumps(rec, allow_nan=True))


def run_pending(
    out: Path, fp: str, todo: list[tuple[int, str]], compute, done: dict[int, dict], progress: bool = True
) -> None:
    """Compute each pending (index, task) with compute(i, task) -> {budget: {method: metrics}} and write its record
    atomically as soon as it is done (an interruption loses at most the document in flight); adds it to `done`."""
    from tqdm import tqdm

    for i, task in tqdm(todo, desc="quality: held-out documents", disable=not progress, unit="doc"):
        t0 = time.perf_counter()
        rows = compute(i, task)
        rec = {
            "format": FORMAT,
            "fingerprint": fp,
            "index": i,
            "task": task,
            "name": f"{task}-{i}",
            "seconds": time.perf_counter() - t0,
            "budgets": rows,
        }
        write_doc(out, rec)
        done[i] = rec


def get_retriever(qc: QualityConfig, cfg, out: Path, engine, tok, targets: tuple[int, ...], log, progress: bool):
    """The run's retriever: --retriever, else the one this out dir trained before (RETRIEVER_DONE), else train the
    demo's (its 6 train / 2 val documents decoded and dumped under out/work, as in the demo's stages 3-4)."""
    from flashmemory.retriever.checkpoint import check_fits, load_retriever

    def fitted(path: str):
        model = load_retriever(path)
        check_fits(model, path, engine.hidden_size, engine.index_head_dim, targets)
        return model.eval()

    if qc.retriever:
        return fitted(qc.retriever), {"checkpoint": qc.retriever}
    done = out / RETRIEVER_DONE
    if done.is_file():
        info = json.loads(done.read_text())
        log(f"[quality] retriever: {info['checkpoint']} (trained by this run earlier)")
        return fitted(info["checkpoint"]), info
    from flashmemory.atomic import atomic_write_text
    from flashmemory.demo.outputs import clean_work_dir
    from flashmemory.demo.pipeline import dump_split, item_run, make_items, train_retriever
    from flashmemory.train.loop import BEST_F1

    clean_work_dir(out)
    items = make_items(cfg, tok)[: cfg.n_train + cfg.n_val]  # the demo's train / val documents
    log(f"[quality] training the demo's retriever on {cfg.n_train} train / {cfg.n_val} val documents ...")
    runs = [item_run(engine, tok, it, f"{it.task}-{i}", cfg, targets) for i, it in enumerate(items)]
    dump_split(runs[: cfg.n_train], out, "train", engine, targets, 0, cfg)
    dump_split(runs[cfg.n_train :], out, "val", engine, targets, cfg.n_train, cfg)
    (out / "work" / "dump" / "test").mkdir(exist_ok=True)
    retriever, summary = train_retriever(cfg, out, targets, progress)
    info = {
        "checkpoint": str(out / "work" / "ckpt" / BEST_F1),
        "summary": {k: v for k, v in summary.items() if k != "losses"},
    }
    atomic_write_text(done, json.dumps(info, indent=1, default=str))
    return retriever, info


def run_quality(qc: QualityConfig, log=print, progress: bool = True, report_only: bool = False) -> dict:
    """Run (or continue) the quality run in qc.out_dir; returns the aggregated results (also written there)."""
    from flashmemory.outdir import DirLock, prepare_dir

    out = prepare_dir(qc.out_dir, "--out-dir")
    with DirLock(out, "quality output directory"):
        claim_run_dir(out, FORMAT, "--out-dir")
        return _run(qc, out, log, progress, report_only)


def _run(qc: QualityConfig, out: Path, log, progress: bool, report_only: bool) -> dict:
    import torch

    from flashmemory.demo.pipeline import default_targets, item_run
    from flashmemory.demo.quality_report import aggregate, write_results
    from flashmemory.eval.harness import HarnessConfig, evaluate_doc
    from flashmemory.eval.methods import METHODS
    from flashmemory.hf import HFEngine
    from flashmemory.tasks.suite import generate
    from flashmemory.tasks.tokenizer import load_tokenizer

    t_start = time.perf_counter()
    cfg, note = demo_config(qc)
    methods = qc.methods or METHODS
    engine = HFEngine.from_name(cfg.model, seed=cfg.seed)
    from flashmemory.tiny.attention import use_band_attention

    use_band_attention(engine.model)
    targets = cfg.target_layers or default_targets(engine.n_c4_layers)
    cfg = replace(cfg, target_layers=targets, min_layers=min(cfg.min_layers, engine.n_c4_layers))
    fp = fingerprint(asdict(cfg), qc, methods)
    plan = doc_plan(cfg.n_train + cfg.n_val, cfg.tasks, qc.tasks, qc.n_per_task)
    done = load_done(out, fp, qc.budgets)
    todo = [(i, t) for i, t in plan if i not in done]
    log(
        f"[quality] {note}; {len(plan)} held-out documents ({qc.n_per_task} per task), {len(plan) - len(todo)} done "
        f"earlier, {len(todo)} to run; budgets {', '.join(f'{b:.0%}' for b in qc.budgets)}; methods "
        f"{', '.join(methods)}; fingerprint {fp}"
    )
    if todo and not report_only:
        tok = load_tokenizer(None)
        torch.manual_seed(cfg.seed)
        retriever, _ = get_retriever(qc, cfg, out, engine, tok, targets, log, progress)
        hc = HarnessConfig(
            tau=cfg.tau,
            page_chunks=cfg.page_chunks,
            tail_chunks=cfg.tail_chunks,
            threshold=cfg.threshold,
            seed=cfg.seed,
            methods=methods,
        )

        def decode_text(ids: list[int]) -> str:
            return tok.decode([i if 0 <= i < tok.vocab_size else tok.unk for i in ids])

        def compute(i: int, task: str) -> dict[str, dict]:
            it = generate(task, cfg.doc_len, n=1, seed=cfg.seed * 1000 + i, tokenizer=tok)[0]
            run = item_run(engine, tok, it, f"{task}-{i}", cfg, targets)
            run.cap = None
            return {str(b): evaluate_doc(engine, run, retriever, hc, targets, b, decode_text) for b in qc.budgets}

        run_pending(out, fp, todo, compute, done, progress)
    recs = [done[i] for i, _ in plan if i in done]
    if not recs:
        raise UserError(f"--out-dir {out}: no finished documents to report")
    results = aggregate(
        recs,
        asdict(cfg) | {"quality": asdict(qc), "fingerprint": fp, "methods": list(methods)},
        note,
        planned=len(plan),
    )
    results["wall_seconds_this_call"] = time.perf_counter() - t_start
    write_results(results, out, log)
    return results


def doc_seconds(recs: list[dict]) -> float:
    """Mean seconds per finished document (decode + every method at every budget); nan without any."""
    return sum(r["seconds"] for r in recs) / len(recs) if recs else math.nan
