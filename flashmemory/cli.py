"""`flashmemory` command line. Each subcommand lives beside the code it drives.

A command module exposes `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flashmemory.errors import UserError, fail, set_debug

# Modules that add subcommands, in --help order.
COMMANDS = [
    "flashmemory.demo.cli",  # demo (the CPU end-to-end run)
    "flashmemory.retriever.cli",  # checkpoint inspect|convert|download
    "flashmemory.dump.cli",  # dump (golden-label training data)
    "flashmemory.train.cli",  # train (joint retriever on golden-label dumps)
    "flashmemory.eval.cli",  # eval (policies vs baselines on a dump)
    "flashmemory.demo.quality_cli",  # eval quality (the demo's pipeline over many held-out documents): after eval
    "flashmemory.eval.live.cli",  # eval live (the task suite through live sglang stacks): after eval
    "flashmemory.train.verify",  # verify (native indexer / checkpoint vs float64 reference)
    "flashmemory.bench.cli",  # bench scorer|labels|recall|train|costmodel|all
    "flashmemory.costmodel.plan_cli",  # plan (a projected node plan: requests per tier, disks, tok/s)
    "flashmemory.tasks.cli",  # tasks generate|score|list
    "flashmemory.tiny.cli",  # model train-tiny|probe (a tiny DeepSeek-V4 that retrieves)
    "flashmemory.serve.cli",  # serve (P, D and the router on CPU, until Ctrl-C)
    "flashmemory.sglang.plumbing.patches_cli",  # patches (every change made to sglang; --check against sglang)
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashmemory",
        description="FlashMemory for DeepSeek-V4: Memory-Indexer retriever, golden-label dumps, training, "
        "offload engine, benchmarks and the CPU demo.",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an expected failure instead of its one-line message "
        "(accepted anywhere on the command line)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return p


def chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser that `args` were parsed by, e.g. the one of `flashmemory eval quality`."""
    for action in parser._actions:  # argparse offers no public walk over a parser's subcommands
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return chosen(action.choices[name], args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Expected failures (`UserError`, `OSError`) print one line named by the whole
    subcommand (`flashmemory checkpoint convert: error: ...`) and exit 2; see `flashmemory.errors`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    set_debug(debug)
    parser = build_parser()
    args, extra = parser.parse_known_args([a for a in argv if a != "--debug"])
    if extra:  # named by the command they were given to, not by `flashmemory` alone
        chosen(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    command = chosen(parser, args).prog.removeprefix(parser.prog).strip() or args.command  # e.g. "eval quality"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"flashmemory {command}: interrupted", file=sys.stderr)
        return 130
    except (UserError, OSError) as e:
        if debug:
            raise
        return fail(command, e)


if __name__ == "__main__":
    sys.exit(main())
