"""`flashmemory eval frontier`: argument parsing for the quality-against-cost sweep (`eval.frontier`)."""

from __future__ import annotations

import argparse

from flashmemory.eval.records import name_list as _tuple


def config_from_args(a: argparse.Namespace):
    """FrontierConfig from the parsed flags (UserError naming a bad flag or file)."""
    from flashmemory.errors import UserError
    from flashmemory.eval.budgets import parse_budgets
    from flashmemory.eval.frontier.run import SWEEP_METHODS, TRAINED_TASKS, FrontierConfig

    budgets = parse_budgets(a.budgets)
    if not budgets:
        raise UserError(f"--budgets {a.budgets!r}: give at least one fraction in (0, 1]")
    if a.max_docs is not None and a.max_docs < 0:
        raise UserError(f"--max-docs {a.max_docs}: must be >= 0")
    return FrontierConfig(
        out_dir=a.out,
        retriever=a.retriever,
        n_per_task=a.n_per_task,
        budgets=budgets,
        methods=_tuple(a.methods) or SWEEP_METHODS,
        tasks=_tuple(a.tasks) or TRAINED_TASKS,
        model=a.model or "",
        doc_len=a.doc_len,
        gen_tokens=a.gen_tokens,
        tau=a.tau,
        page_chunks=a.page_chunks,
        tail_chunks=a.tail_chunks,
        threshold=a.threshold,
        first_doc=a.first_doc,
        seed=a.seed,
    )


def run(a: argparse.Namespace) -> int:
    from flashmemory.errors import UserError, fail
    from flashmemory.eval.frontier.run import fingerprint, run_frontier
    from flashmemory.retriever.checkpoint import CheckpointError

    try:
        fc = config_from_args(a)
        fingerprint(fc)  # reads the retriever: a missing file is named before any model loads
        run_frontier(
            fc,
            progress=not a.no_progress,
            report_only=a.report_only,
            max_docs=a.max_docs,
            compare=a.compare,
            recost=a.recost,
        )
    except (UserError, CheckpointError, ValueError, OSError) as e:
        return fail("eval frontier", e)
    return 0


def register_frontier(sub: argparse._SubParsersAction) -> None:
    """Add `frontier` to `flashmemory eval`'s subcommands."""
    p = sub.add_parser(
        "frontier",
        help="task quality against cost over a page-budget sweep (FlashMemory, HiSparse, Full), resumable",
        description="Every method at every page budget on held-out documents of the shipped trained model: task "
        "accuracy, agreement with Full and top-k mass (n and 95%% intervals), costs per request and "
        "token (device bytes, H2D bytes, indexer entries, Level-1 FLOPs) with HiSparse's from an LRU "
        "replay of its swap-in, and the DeepSeek-V4-Flash projection. Each document is written as it "
        "finishes; rerun the same command to continue. Writes frontier.json, frontier.md and "
        "frontier.png to --out (locked while it runs).",
    )
    p.add_argument("--out", default="frontier_out", help="output dir (default %(default)s)")
    p.add_argument("--retriever", required=True, help="retriever checkpoint (e.g. the one `eval quality` trained)")
    p.add_argument("--n-per-task", type=int, default=24, help="documents per task (default %(default)s)")
    p.add_argument("--budgets", default="0.05,0.1,0.2,0.4,0.8,1", help="page shares in (0, 1] (default %(default)s)")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated harness methods (default FlashMemory,"
        "FlashMemory+monitor,Oracle,Recency; Full and HiSparse always)",
    )
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: the trained model's three)")
    p.add_argument("--model", default=None, help="tiny model name or checkpoint dir (default: the shipped trained)")
    p.add_argument("--doc-len", type=int, default=4096, help="prompt tokens per document (default %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=24, help="decode steps per document (default %(default)s)")
    p.add_argument("--tau", type=int, default=16, help="Level-1 interval in decode steps (default %(default)s)")
    p.add_argument("--page-chunks", type=int, default=8, help="chunks per page (default %(default)s)")
    p.add_argument("--tail-chunks", type=int, default=8, help="recency tail, chunks (default %(default)s)")
    p.add_argument("--threshold", type=float, default=0.5, help="FlashMemory score threshold (default %(default)s)")
    p.add_argument(
        "--first-doc",
        type=int,
        default=8,
        help="index of the first document (default %(default)s: past the retriever's 6 train / 2 val documents)",
    )
    p.add_argument("--seed", type=int, default=0, help="document seeds are seed * 1000 + index (default 0)")
    p.add_argument("--max-docs", type=int, default=None, help="run at most this many new documents, then report")
    p.add_argument(
        "--compare",
        default=None,
        help="another frontier --out dir (e.g. a --methods FlashMemory-fill "
        "run): its extra methods beside FlashMemory, same documents",
    )
    p.add_argument("--report-only", action="store_true", help="only aggregate the documents already done")
    p.add_argument(
        "--recost",
        action="store_true",
        help="recompute the finished documents' HiSparse costs from their stored stats (no model runs), then "
        "report; a run refuses records of an older cost revision until this is done",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)
