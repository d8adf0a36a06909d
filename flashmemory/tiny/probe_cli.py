"""`flashmemory model probe`: the three retrieval measurements of `flashmemory.tiny.probe` as a table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashmemory.tiny.shipped import TRAINED_NAME, trained_model_dir


def add_probe_parser(msub) -> None:
    p = msub.add_parser(
        "probe", help="accuracy under Full / answer-masked / random-masked c4, indexer recall", description=__doc__
    )
    p.add_argument("--model", default=None, help=f"checkpoint directory (default: the shipped {TRAINED_NAME})")
    p.add_argument("--tasks", default="niah_single,niah_multikey,mqar", help="comma-separated curriculum tasks")
    p.add_argument("--n-docs", type=int, default=12, help="held-out documents per task")
    p.add_argument("--length", type=int, default=1024, help="document length in tokens")
    p.add_argument("--seed", type=int, default=0, help="held-out document seed and random-mask seed")
    p.add_argument("--out-dir", default=None, help="also write probe.md and probe.json here")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run_probe)


def run_probe(a: argparse.Namespace) -> int:
    import torch

    from flashmemory.hf import HFEngine
    from flashmemory.tiny.attention import use_band_attention
    from flashmemory.tiny.data import MIX, heldout_docs
    from flashmemory.tiny.probe import probe_docs, probe_table, rows_json

    try:
        tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
        bad = [t for t in tasks if t not in {m[0] for m in MIX}]
        if bad or not tasks:
            raise ValueError(f"--tasks: unknown {bad}; choose from {[m[0] for m in MIX]}")
        if a.n_docs < 1:
            raise ValueError("--n-docs must be >= 1")
        path = a.model or str(trained_model_dir())
        engine = HFEngine.from_name(path, num_threads=1)
        use_band_attention(engine.model)
        docs = [d for t in tasks for d in heldout_docs(t, a.n_docs, a.length, seed=a.seed)]
    except (ValueError, FileNotFoundError) as e:
        if a.debug:
            raise
        print(f"flashmemory model probe: error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(a.seed)
    rows = probe_docs(engine, docs, seed=a.seed)
    table = probe_table(rows, engine.index_topk)
    head = (
        f"Model `{path}`; held-out documents (seed namespace `heldout:{a.seed}`), {a.length} tokens, evidence "
        f"depth 0-0.9; index top-{engine.index_topk}, sliding window {engine.config.sliding_window}."
    )
    print(head + "\n\n" + table)
    if a.out_dir:
        from flashmemory.atomic import atomic_write_text

        out = Path(a.out_dir)
        atomic_write_text(out / "probe.md", head + "\n\n" + table + "\n")
        atomic_write_text(
            out / "probe.json",
            json.dumps({"model": path, "length": a.length, "seed": a.seed, "rows": rows_json(rows)}, indent=1),
        )
    return 0
