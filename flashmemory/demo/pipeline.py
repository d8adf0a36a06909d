"""`flashmemory demo`: the whole FlashMemory loop on CPU, end to end, with the real code at each stage.

1. build the tiny seeded DeepSeek-V4 (transformers, 43-layer Flash pattern by default);
2. generate a long-context task set (RULER-style needles, variable tracking, cwe/fwe, MRCR-like);
3. decode every document under Full attention and dump it with golden labels (the dump format);
4. train a retriever on the train split (`flashmemory.train`, causal sampling), pick it on the val split;
5. on held-out documents, replay decode through the offload engine and Level 1 for each method at the
   same page budget, then enforce each resident set at Level 2 in a teacher-forced forward;
6. FlashMemory against FlashMemory+monitor per task, on the test documents plus extra held-out MRCR-like ones,
   at an equal average budget; resident pages against context length on a control document;
7. with `serve` (`make demo`): start sglang's P, D (FlashMemory on) and the router on CPU, send chats through the
   router and read D's live FlashMemory counters (`flashmemory.demo.serve_stage`);
8. write demo_out/report.md, results.json and a coverage-vs-budget plot.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from flashmemory.demo.config import SERVE_STAGE, DemoConfig
from flashmemory.demo.outputs import OUTPUTS, clean_work_dir, move_aside_outputs, record_outputs
from flashmemory.errors import UserError
from flashmemory.eval.decode import DocRun, full_run
from flashmemory.eval.harness import HarnessConfig, budget_cells, evaluate_doc, mean_rows
from flashmemory.outdir import DirLock, prepare_dir
from flashmemory.serve.tiny_retriever import dump_runs

SLOW_FACTOR = 3.0  # a stage this many times slower than measured on a quiet machine gets a warning ...
SLOW_EXCESS = 30.0  # ... once it is also this many seconds over (a 1-second stage taking 3 s is noise)


def slow_after(expected: float, factor: float = SLOW_FACTOR, excess: float = SLOW_EXCESS) -> float:
    """Seconds after which a stage expected to take `expected` s counts as far slower than expected."""
    return max(factor * expected, expected + excess)


def slow_warning(
    name: str, elapsed: float, expected: float, factor: float = SLOW_FACTOR, excess: float = SLOW_EXCESS
) -> str | None:
    """The one-line warning for a stage running far slower than measured on a quiet 2-core machine, else None."""
    if expected <= 0 or elapsed < slow_after(expected, factor, excess):
        return None
    return (
        f"[demo] warning: stage '{name}' has taken {elapsed:.0f} s, over {factor:.0f}x the ~{expected:.0f} s it "
        "takes on a quiet 2-core machine; other processes are probably competing for the CPU (see `top`). "
        "It will finish, only later"
    )


class Stages:
    """Wall time per stage, printed as each one ends. With `expected` seconds per stage, a stage still running
    at SLOW_FACTOR x its expected time prints `slow_warning` once, while it runs (a timer thread)."""

    def __init__(self, log, expected: dict[str, float] | None = None, excess: float = SLOW_EXCESS):
        self.times: dict[str, float] = {}
        self.log = log
        self.expected = expected or {}
        self.excess = excess
        self.warned: list[str] = []

    def _warn(self, name: str, t0: float) -> None:
        msg = slow_warning(name, time.perf_counter() - t0, self.expected[name], excess=self.excess)
        if msg:
            self.warned.append(name)
            self.log(msg)

    @contextmanager
    def __call__(self, name: str):
        self.log(f"[demo] {name} ...")
        t0 = time.perf_counter()
        timer = None
        if self.expected.get(name, 0) > 0:
            timer = threading.Timer(slow_after(self.expected[name], excess=self.excess), self._warn, (name, t0))
            timer.daemon = True
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.cancel()
        self.times[name] = time.perf_counter() - t0
        self.log(f"[demo] {name} done in {self.times[name]:.1f} s")


def default_targets(n_c4: int) -> tuple[int, ...]:
    """10, 12, 20 on the full layer pattern, else the last three c4 layers (all of them when fewer)."""
    if n_c4 >= 21:
        return (10, 12, 20)
    if n_c4 < 1:
        raise ValueError("the model has no c4 layers; the retriever needs at least one")
    return tuple(range(max(0, n_c4 - 3), n_c4))


def make_items(cfg: DemoConfig, tok) -> list:
    from flashmemory.tasks.suite import generate

    items = []
    for i in range(cfg.n_docs):
        task = cfg.tasks[i % len(cfg.tasks)]
        items.append(generate(task, cfg.doc_len, n=1, seed=cfg.seed * 1000 + i, tokenizer=tok)[0])
    return items


def make_all_items(cfg: DemoConfig, tok) -> tuple[list, list]:
    """The run's task items and its extra monitor items (stage 6), generated up front: a `--doc-len` too short for
    one of them is a UserError naming the flag now, not after minutes of decoding."""
    from flashmemory.tasks.suite import generate

    try:
        items = make_items(cfg, tok)
        extra = [
            generate(task, cfg.doc_len, n=1, seed=cfg.seed * 1000 + cfg.n_docs + j, tokenizer=tok)[0]
            for j, task in enumerate(cfg.monitor_tasks)
        ]
    except ValueError as e:
        raise UserError(f"--doc-len {cfg.doc_len}: {e}") from None
    return items, extra


def item_run(engine, tok, it, name: str, cfg: DemoConfig, targets: tuple[int, ...]) -> DocRun:
    """One task item decoded greedily under Full attention and captured (`eval.decode.full_run`) with the demo's
    generation length, label top-p and minimum layers; the run's record is the item's."""
    return full_run(
        engine,
        name,
        tok.encode_chat(it.messages),
        cfg.gen_tokens,
        targets,
        cfg.topp,
        cfg.min_layers,
        record=it.to_record(),
    )


def dump_split(
    runs: list[DocRun], out: Path, split: str, engine, targets: tuple[int, ...], start: int, cfg: DemoConfig
) -> None:
    """The golden-label dump of one split (`out/work/dump/<split>`, documents numbered from `start`) with the
    demo's label top-p, minimum layers and generation length."""
    dump_runs(
        runs,
        out / "work" / "dump" / split,
        engine,
        targets,
        start,
        topp=cfg.topp,
        min_layers=cfg.min_layers,
        max_tokens=cfg.gen_tokens,
    )


def train_retriever(cfg: DemoConfig, out: Path, targets: tuple[int, ...], progress: bool = True):
    from flashmemory.retriever.checkpoint import load_retriever
    from flashmemory.train.loop import BEST_F1, TrainConfig, Trainer
    from flashmemory.train.samples import SampleConfig

    work = out / "work"
    data = {
        "train": [{"data_dir": "dump/train"}],
        "val": [{"data_dir": "dump/val"}],
        "test": [{"data_dir": "dump/test"}],
    }
    (work / "data_config.json").write_text(json.dumps(data, indent=1))
    tc = TrainConfig(
        data_config=str(work / "data_config.json"),
        output_dir=str(work / "ckpt"),
        no_pretrain=True,
        joint_layers=targets,
        n_heads=cfg.n_heads,
        q_lora_rank=cfg.q_lora_rank,
        lr=cfg.lr,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        focal_loss=True,
        threshold=cfg.threshold,
        sample=SampleConfig(label_interval=cfg.tau, max_pos=128, neg_ratio=3.0),
        seed=cfg.seed,
        device="cpu",
        log_interval=10**9,
        progress=progress,
    )
    summary = Trainer(tc).fit()
    return load_retriever(work / "ckpt" / BEST_F1), summary


def run_demo(
    cfg: DemoConfig,
    log=print,
    progress: bool = True,
    expected: dict[str, float] | None = None,
    user_set: frozenset[str] = frozenset(),
) -> dict:
    """Run every stage; returns the results dict that is also written to `out_dir/results.json`.

    The output dir is locked for the run. expected: seconds per stage on a quiet machine (`slow_warning`).
    user_set: config fields the user gave explicitly (kept when `model="auto"` picks the trained model)."""
    out = prepare_dir(cfg.out_dir, "--out-dir")
    with DirLock(out, "demo output directory"):
        return _run_demo(cfg, out, log, progress, expected, user_set)


def _run_demo(
    cfg: DemoConfig, out: Path, log, progress: bool, expected: dict[str, float] | None, user_set: frozenset[str]
) -> dict:
    from flashmemory.demo.config import resolve_model
    from flashmemory.demo.report import write_outputs
    from flashmemory.hf import HFEngine
    from flashmemory.tasks.tokenizer import load_tokenizer

    cfg, model_note = resolve_model(cfg, user_set)
    if cfg.serve:
        from flashmemory.demo.serve_stage import check_serve_modules

        check_serve_modules()
    tok = load_tokenizer(None)
    items, monitor_items = make_all_items(cfg, tok)  # before any work: a --doc-len too short is named now
    torch.manual_seed(cfg.seed)
    move_aside_outputs(out, OUTPUTS if cfg.plot else OUTPUTS[:3], log)
    # A re-run starts clean; only the demo's own work folder is removed, so a dump a user made at
    # demo_out/dump (training/README.md) is left alone.
    clean_work_dir(out)
    stage = Stages(log, expected)

    with stage("1. build model"):
        log(f"       {model_note}")
        engine = HFEngine.from_name(cfg.model, seed=cfg.seed)
        if Path(cfg.model).is_dir():
            from flashmemory.tiny.attention import use_band_attention

            use_band_attention(engine.model)  # equal to eager (tests/tiny), O(S (W + S/4)) per full forward
        targets = cfg.target_layers or default_targets(engine.n_c4_layers)
        cfg = replace(cfg, target_layers=targets, min_layers=min(cfg.min_layers, engine.n_c4_layers))
        log(
            f"       {cfg.model}: {engine.n_c4_layers} c4 layers, index top-{engine.index_topk}, "
            f"retriever on c4 layers {targets}"
        )
    with stage("2. generate tasks"):
        from flashmemory.tasks.suite import write_jsonl

        write_jsonl(items, str(out / "tasks.jsonl"))
        record_outputs(out, ("tasks.jsonl",))
    with stage("3. decode under Full attention, dump golden labels"):
        runs = []
        for i, it in enumerate(tqdm(items, desc="full decode + capture", disable=not progress)):
            runs.append(item_run(engine, tok, it, f"{it.task}-{i}", cfg, targets))
        splits = {
            "train": runs[: cfg.n_train],
            "val": runs[cfg.n_train : cfg.n_train + cfg.n_val],
            "test": runs[cfg.n_train + cfg.n_val :],
        }
        start = 0
        for name, rs in splits.items():
            dump_split(rs, out, name, engine, targets, start, cfg)
            start += len(rs)
        for r in runs:
            r.cap = None  # the dump holds what training needs; keep memory flat
        n_labels = sum(int(r.labels.indices.numel()) for r in runs)
        log(f"       {len(runs)} documents, {n_labels} golden labels")
    with stage("4. train retriever"):
        retriever, summary = train_retriever(cfg, out, targets, progress)
    test_runs = splits["test"]
    hc = HarnessConfig(
        tau=cfg.tau, page_chunks=cfg.page_chunks, tail_chunks=cfg.tail_chunks, threshold=cfg.threshold, seed=cfg.seed
    )
    with stage("5. two-level recall through the offload engine"):

        def decode_text(ids: list[int]) -> str:  # the model's vocabulary is larger than the tiny tokenizer's
            return tok.decode([i if 0 <= i < tok.vocab_size else tok.unk for i in ids])

        per_doc = [
            evaluate_doc(engine, r, retriever, hc, targets, cfg.budget, decode_text)
            for r in tqdm(test_runs, desc="methods x test docs", disable=not progress)
        ]
        task_by_budget = {}
        for b in cfg.task_budgets:
            rows = (
                per_doc
                if b == cfg.budget
                else [
                    evaluate_doc(engine, r, retriever, hc, targets, b, decode_text)
                    for r in tqdm(test_runs, desc=f"task accuracy at {b:.0%}", disable=not progress)
                ]
            )
            task_by_budget[str(b)] = budget_cells(rows, [r.record["task"] for r in test_runs])  # + intervals
        sweep = {}
        for b in tqdm(cfg.sweep, desc="budget sweep", disable=not progress):
            sweep[b] = mean_rows([evaluate_doc(engine, r, retriever, hc, targets, b, quality=False) for r in test_runs])
    with stage("6. miss monitor: per task, and residency against length"):
        from flashmemory.eval.residency import ResidencyConfig, extend_costmodel, residency_vs_length

        extra = []
        for j, it in enumerate(monitor_items):
            extra.append(item_run(engine, tok, it, f"{it.task}-{cfg.n_docs + j}", cfg, targets))
            extra[-1].cap = None
        mhc = replace(hc, methods=("FlashMemory", "FlashMemory+monitor"))
        per_task: dict[str, list] = {}
        for r, d in zip(test_runs, per_doc):
            per_task.setdefault(r.name.rsplit("-", 1)[0], []).append({k: d[k] for k in ("Full", *mhc.methods)})
        for r in extra:
            per_task.setdefault(r.name.rsplit("-", 1)[0], []).append(
                evaluate_doc(engine, r, retriever, mhc, targets, cfg.budget, decode_text)
            )
        rc = ResidencyConfig(
            lengths=cfg.residency_lengths,
            gen_tokens=cfg.gen_tokens,
            kmax=cfg.residency_kmax,
            page_chunks=cfg.page_chunks,
            tau=cfg.tau,
            tail_chunks=cfg.tail_chunks,
            threshold=cfg.threshold,
            seed=cfg.seed,
        )
        residency = residency_vs_length(engine, retriever, tok, rc, log=log)
    results = {
        "config": asdict(cfg),
        "monitor_tasks": {task: mean_rows(rows) for task, rows in per_task.items()},
        "residency": {"rows": residency, "costmodel": extend_costmodel(residency)},
        "methods": mean_rows(per_doc),
        "per_doc": {r.name: d for r, d in zip(test_runs, per_doc)},
        "sweep": {str(b): v for b, v in sweep.items()},
        "task_by_budget": task_by_budget,
        "model_note": model_note,
        "train": {k: v for k, v in summary.items() if k != "losses"},
        "stage_seconds": stage.times,
        "slow_stages": stage.warned,
    }
    if cfg.serve:
        from flashmemory.demo.serve_stage import serve_demo
        from flashmemory.train.loop import BEST_F1

        with stage(SERVE_STAGE):
            msgs = [it.messages for it in items[cfg.n_train + cfg.n_val :]][: cfg.serve_requests]
            results["serving"] = serve_demo(
                cfg.model,
                out / "work" / "ckpt" / BEST_F1,
                targets,
                msgs,
                out,
                cfg.serve_tokens,
                cfg.serve_kmax,
                cfg.serve_prompt_chars,
                log=log,
                train_messages=[it.messages for it in items[: cfg.n_train + cfg.n_val]],
            )
        results["stage_seconds"] = stage.times
    with stage("8. report"):
        write_outputs(results, out, plot=cfg.plot, log=log)
        record_outputs(out, OUTPUTS)
    return results
