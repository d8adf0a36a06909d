"""`flashmemory eval quality`: argument parsing for the resumable quality run (`flashmemory.demo.quality`)."""

from __future__ import annotations

import argparse

from flashmemory.eval.records import name_list as _tuple


def config_from_args(a: argparse.Namespace):
    """QualityConfig from the parsed flags (UserError naming a bad flag)."""
    from flashmemory.demo.quality import QualityConfig
    from flashmemory.errors import UserError
    from flashmemory.eval.budgets import parse_budgets

    budgets = parse_budgets(a.budgets)
    if not budgets:
        raise UserError(f"--budgets {a.budgets!r}: give at least one fraction in (0, 1]")
    return QualityConfig(
        out_dir=a.out_dir,
        n_per_task=a.n_per_task,
        budgets=budgets,
        methods=_tuple(a.methods),
        tasks=_tuple(a.tasks),
        tau=a.tau,
        seed=a.seed,
        retriever=a.retriever or "",
    )


def run(a: argparse.Namespace) -> int:
    from flashmemory.demo.quality import run_quality
    from flashmemory.errors import UserError, fail

    try:
        qc = config_from_args(a)
        run_quality(qc, progress=not a.no_progress, report_only=a.report_only)
    except (UserError, ValueError) as e:
        return fail("eval quality", e)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `quality` as a subcommand of `flashmemory eval` (registered before this, by `flashmemory.eval.cli`).
    It lives here, not in eval/, because it runs the demo's pipeline and report, which sit above eval."""
    register_quality(subparsers.choices["eval"])


def register_quality(eval_parser: argparse.ArgumentParser) -> None:
    """Add `quality` as a subcommand of `flashmemory eval`."""
    sub = getattr(eval_parser, "fm_subcommands", None) or eval_parser.add_subparsers(
        dest="eval_command", metavar="{quality}"
    )
    p = sub.add_parser(
        "quality",
        help="the demo's quality table over many held-out documents, resumable",
        description="The demo's pipeline (shipped trained model, the demo's retriever) over N held-out documents "
        "per task: every method at every budget, each document's result written atomically as it "
        "finishes; rerun the same command to continue an interrupted run. Writes results.json and "
        "report.md (every cell with n and a 95% interval) to --out-dir, which is locked while it runs. "
        "About 30 s per document on a shared 2-core machine.",
    )
    p.add_argument(
        "--out-dir",
        default="quality_out",
        help="output dir (docs/ per document, results.json, report.md, work/ for the retriever) (default %(default)s)",
    )
    p.add_argument("--n-per-task", type=int, default=48, help="held-out documents per task (default %(default)s)")
    p.add_argument("--budgets", default="0.1,0.2", help="page budgets, fractions in (0, 1] (default %(default)s)")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: all; Full always runs)")
    p.add_argument("--tasks", default=None, help="comma-separated subset of the trained model's tasks (default: all)")
    p.add_argument("--tau", type=int, default=0, help="Level-1 interval in decode steps (default 0: the demo's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the retriever and documents (default %(default)s)")
    p.add_argument("--retriever", default=None, help="retriever checkpoint to use instead of training the demo's")
    p.add_argument("--report-only", action="store_true", help="only aggregate the documents already done")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)
