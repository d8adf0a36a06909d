"""`flashmemory eval --residency`: resident pages per request against context length on a control document.

Needs --checkpoint (the retriever) and --model (the CPU engine's tiny model); prints the measured table and its
cost-model extension to 1M tokens, optionally as JSON. Long lengths are slow on CPU (one full forward each:
8K tokens of tiny-flash take minutes), so the demo runs the short ones and this command the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def run_residency(a: argparse.Namespace) -> int:
    from flashmemory.eval.residency import ResidencyConfig, extend_costmodel, residency_table, residency_vs_length
    from flashmemory.hf import HFEngine
    from flashmemory.retriever.checkpoint import CheckpointError, load_retriever
    from flashmemory.tasks.tokenizer import load_tokenizer

    try:
        lengths = tuple(int(x) for x in a.lengths.split(",") if x.strip())
        if not lengths or min(lengths) < 64:
            raise ValueError(f"--lengths {a.lengths!r}: comma-separated prompt lengths of at least 64 tokens")
        if a.kmax_pages < 1:
            raise ValueError(f"--kmax-pages must be >= 1, got {a.kmax_pages}")
        retriever = load_retriever(a.checkpoint).eval()
        engine = HFEngine.from_name(a.model, seed=a.seed)
        bad = [t for t in retriever.layers if t >= engine.n_c4_layers]
        if bad:
            raise CheckpointError(f"{a.checkpoint}: layers {bad} do not exist in {a.model}")
        tok = load_tokenizer(a.tokenizer)
        rc = ResidencyConfig(
            lengths=lengths,
            gen_tokens=a.gen_tokens,
            kmax=a.kmax_pages,
            page_chunks=a.page_chunks,
            tau=a.tau,
            tail_chunks=a.tail_chunks,
            threshold=a.threshold,
            seed=a.seed,
        )
    except (CheckpointError, ValueError, OSError) as e:
        print(f"flashmemory eval --residency: error: {e}", file=sys.stderr)
        return 2
    rows = residency_vs_length(engine, retriever, tok, rc)
    ext = extend_costmodel(rows)
    print(residency_table(rows, ext))
    print(
        f"control document (filler, nothing to retrieve); KMAX {rc.kmax} pages of {rc.page_chunks} chunks, cap "
        f"2 x KMAX with the monitor; tau {rc.tau}; {rc.gen_tokens} decode steps per length."
    )
    if a.json:
        from flashmemory.atomic import atomic_write_text

        atomic_write_text(
            a.json, json.dumps({"config": asdict(rc), "rows": rows, "costmodel": ext}, indent=1, default=str)
        )
    return 0


def add_residency_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "--residency mode (resident pages against context length; uses --checkpoint, --model, "
        "--page-chunks, --tail-chunks, --tau, --threshold, --gen-tokens)"
    )
    g.add_argument(
        "--residency",
        action="store_true",
        help="measure resident pages per request on a control document at each of --lengths",
    )
    g.add_argument("--lengths", default="1024,2048,4096,8192", help="prompt lengths in tokens (default %(default)s)")
    g.add_argument("--kmax-pages", type=int, default=6, help="fixed page budget KMAX (default %(default)s)")
