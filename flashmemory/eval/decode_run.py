"""`flashmemory eval --decode`: per task and method, decode with the resident set enforced at Level 2.

Input: a task JSONL from `flashmemory tasks generate` (tiny tokenizer), a model (shipped tiny name or a
local checkpoint directory) and a retriever checkpoint. Output: one row per (task, method) with
agreement with Full, native top-k mass covered, golden recall, resident fraction and the task score of
the teacher-forced greedy tokens; plus JSON. A mechanics check on tiny models, not an accuracy claim.
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

COLS = (
    ("agreement", "agree"),
    ("mass", "mass"),
    ("golden_recall", "golden"),
    ("resident_frac", "resident"),
    ("task_score", "task"),
)


def format_cells(cells: dict[str, dict[str, dict]]) -> str:
    head = f"{'task':<16} {'method':<12} " + " ".join(f"{h:>9}" for _, h in COLS)
    lines = [head, "-" * len(head)]
    for task, methods in cells.items():
        for name, m in methods.items():
            vals = " ".join(f"{m.get(k, float('nan')):>9.3f}" for k, _ in COLS)
            lines.append(f"{task:<16} {name:<12} {vals}")
    return "\n".join(lines)


def run_decode(a: argparse.Namespace) -> int:
    from flashmemory.eval.decode import full_run
    from flashmemory.eval.harness import HarnessConfig, evaluate_doc, mean_rows
    from flashmemory.hf import HFEngine
    from flashmemory.retriever.checkpoint import CheckpointError, load_retriever
    from flashmemory.tasks.suite import read_jsonl
    from flashmemory.tasks.tokenizer import load_tokenizer

    try:
        if not a.tasks:
            raise ValueError("--decode needs --tasks FILE.jsonl (from `flashmemory tasks generate`)")
        if not 0.0 < a.budget <= 1.0:
            raise ValueError(f"--budget must lie in (0, 1], got {a.budget}")
        records = read_jsonl(a.tasks)
        if not records:
            raise ValueError(f"{a.tasks}: no task items")
        retriever = load_retriever(a.checkpoint).eval()
        engine = HFEngine.from_name(a.model, seed=a.seed)
        targets = tuple(retriever.layers)
        bad = [t for t in targets if t >= engine.n_c4_layers]
        if bad:
            raise CheckpointError(
                f"{a.checkpoint}: layers {bad} do not exist in {a.model} ({engine.n_c4_layers} c4 layers)"
            )
        methods = tuple(m.strip() for m in a.methods.split(",")) if a.methods else None
        hc = HarnessConfig(
            tau=a.tau,
            page_chunks=a.page_chunks,
            tail_chunks=a.tail_chunks,
            threshold=a.threshold,
            seed=a.seed,
            **({"methods": methods} if methods else {}),
        )
        tok = load_tokenizer(a.tokenizer)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"flashmemory eval --decode: error: {e}", file=sys.stderr)
        return 2

    def text(ids: list[int]) -> str:
        vs = getattr(tok, "vocab_size", None)
        return tok.decode([i for i in ids if vs is None or 0 <= i < vs])

    per_task: dict[str, list] = {}
    for i, rec in enumerate(tqdm(records, desc="tasks", disable=a.no_progress)):
        msgs = json.loads(rec["prompt"])
        run = full_run(
            engine,
            f"{rec.get('task', 'item')}-{i}",
            tok.encode_chat(msgs),
            a.gen_tokens,
            targets,
            min_layers=min(3, engine.n_c4_layers),
            record=rec if "task" in rec else None,
        )
        run.cap = None
        per_task.setdefault(rec.get("task", "item"), []).append(
            evaluate_doc(engine, run, retriever, hc, targets, a.budget, text)
        )
    cells = {task: mean_rows(rows) for task, rows in per_task.items()}
    print(format_cells(cells))
    print(
        f"budget {a.budget:.0%} of pages for every method; tau {a.tau}; pages of {a.page_chunks} chunks. "
        "Mechanics check on a tiny model: it ranks policies, it is not an accuracy claim."
    )
    if a.json:
        from flashmemory.atomic import atomic_write_text

        atomic_write_text(
            a.json, json.dumps({"config": vars(a) | {"func": None}, "cells": cells}, indent=1, default=str)
        )
    return 0


def add_decode_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--decode mode (quality harness on a task set)")
    g.add_argument(
        "--decode",
        action="store_true",
        help="decode each task item with every method enforced at Level 2 (needs --tasks, --checkpoint, --model)",
    )
    g.add_argument("--tasks", default=None, help="task JSONL from `flashmemory tasks generate`")
    g.add_argument("--model", default="micro", help="tiny model name or local checkpoint dir (default %(default)s)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the shipped tiny tokenizer)")
    g.add_argument("--gen-tokens", type=int, default=32, help="decode steps per item (default %(default)s)")
    g.add_argument("--budget", type=float, default=0.25, help="page budget, fraction in (0, 1] (default %(default)s)")
    g.add_argument("--page-chunks", type=int, default=8, help="chunks per page (default %(default)s)")
    g.add_argument("--tail-chunks", type=int, default=8, help="recency tail in chunks (default %(default)s)")
    g.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of FlashMemory,FlashMemory+monitor,"
        "Recency,Random,Oracle,Reactive (default: all; +monitor runs at "
        "FlashMemory's measured average budget)",
    )
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
