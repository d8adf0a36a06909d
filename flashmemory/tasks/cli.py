"""`flashmemory tasks generate|score|list`: write long-context task JSONL (dump input format) and score outputs."""

from __future__ import annotations

import argparse
import json

from tqdm import tqdm

from flashmemory.errors import fail
from flashmemory.tasks.suite import TASKS, generate, read_jsonl, score, write_jsonl
from flashmemory.tasks.tokenizer import TokenizerError, load_tokenizer

EPILOG = """examples:
  flashmemory tasks generate --task niah_single --length 2048 --n 4 --seed 0 --out niah.jsonl
  flashmemory tasks generate --task all --length 8192 --n 2 --tokenizer /models/ds_fp8 --out suite.jsonl
  flashmemory tasks score --items niah.jsonl --outputs outputs.jsonl

Each line holds prompt (JSON-encoded OpenAI messages), answer, answers, task, length, n_tokens (<= length),
depth (requested), needle_depth (measured token fraction) and random_string_to_prepend (MRCR prefix or "")."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tasks",
        help="long-context task suite: generate JSONL, score outputs",
        description="RULER-style NIAH / variable tracking / cwe / fwe and an MRCR-like chat task, "
        "sized in tokens of the tiny tokenizer or a local HF tokenizer.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tsub = p.add_subparsers(dest="tasks_cmd", metavar="ACTION")

    g = tsub.add_parser(
        "generate",
        help="write task items as JSONL",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument(
        "--task",
        required=True,
        choices=[*TASKS, "all"],
        metavar="TASK",
        help="one of: " + ", ".join(f"{k} ({v.help})" for k, v in TASKS.items()) + "; or all",
    )
    g.add_argument("--length", type=int, required=True, help="prompt length in tokens (upper bound, filled to it)")
    g.add_argument("--n", type=int, default=1, help="items per task (default 1)")
    g.add_argument("--seed", type=int, default=0, help="base seed; item i uses (task, seed, i) (default 0)")
    g.add_argument(
        "--depth",
        type=float,
        default=None,
        help="needle depth in [0, 1] as a token fraction of the context (default: items sweep 0..1)",
    )
    g.add_argument(
        "--count",
        type=int,
        default=None,
        help="needles / values / chain length / words / identical requests (default per task: "
        + ", ".join(f"{k} {v.default_count}" for k, v in TASKS.items())
        + ")",
    )
    g.add_argument(
        "--tokenizer",
        default="tiny",
        help="'tiny' (shipped word-level, ids < 1024) or a local HF tokenizer directory (default tiny)",
    )
    g.add_argument("--out", required=True, help="output JSONL path (written atomically)")
    g.set_defaults(func=_generate)

    s = tsub.add_parser("score", help="score model outputs against task JSONL")
    s.add_argument("--items", required=True, help="task JSONL from `tasks generate`")
    s.add_argument(
        "--outputs", required=True, help='JSONL with one {"output": text} per line, in the same order as --items'
    )
    s.set_defaults(func=_score)

    ls = tsub.add_parser("list", help="list the tasks")
    ls.set_defaults(func=_list)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _generate(args: argparse.Namespace) -> int:
    try:
        tok = load_tokenizer(args.tokenizer)
    except TokenizerError as e:
        return fail("tasks generate", e)
    names = list(TASKS) if args.task == "all" else [args.task]
    items = []
    try:
        for name in tqdm(names, desc="tasks", disable=len(names) == 1):
            items += generate(
                name, args.length, n=args.n, seed=args.seed, depth=args.depth, count=args.count, tokenizer=tok
            )
    except ValueError as e:
        return fail("tasks generate", e)
    n = write_jsonl(items, args.out)
    print(f"wrote {n} items ({', '.join(names)}) of <= {args.length} {tok.name} tokens to {args.out}")
    return 0


def _score(args: argparse.Namespace) -> int:
    try:
        items = read_jsonl(args.items)
        outs = []
        with open(args.outputs, encoding="utf-8") as fh:
            for ln, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        outs.append(str(json.loads(line)["output"]))
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise ValueError(f'{args.outputs} line {ln}: expected {{"output": ...}} ({e})') from None
    except (OSError, ValueError) as e:
        return fail("tasks score", e)
    if len(outs) != len(items):
        return fail("tasks score", f"{args.items} has {len(items)} items but {args.outputs} has {len(outs)} outputs")
    per: dict[str, list[float]] = {}
    for it, out in zip(items, outs):
        per.setdefault(it["task"], []).append(score(it, out))
    print(f"{'task':16s} {'n':>4s} {'score':>6s}")
    for t, v in per.items():
        print(f"{t:16s} {len(v):4d} {sum(v) / len(v):6.3f}")
    allv = [x for v in per.values() for x in v]
    print(f"{'all':16s} {len(allv):4d} {sum(allv) / len(allv):6.3f}")
    return 0


def _list(args: argparse.Namespace) -> int:
    for k, v in TASKS.items():
        print(f"{k:16s} count={v.default_count:<3d} depth={'yes' if v.uses_depth else 'no ':3s}  {v.help}")
    return 0
