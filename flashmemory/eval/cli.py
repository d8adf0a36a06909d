"""`flashmemory eval`: a retriever checkpoint vs baselines on a dump, at equal resident budgets."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from flashmemory.eval.budgets import parse_budgets  # noqa: F401 - re-exported for eval's modes


def retriever_scores(model, ensemble: str = "max"):
    """(doc, t) -> ensemble sigmoid scores [n_t] of `model`, cached per (doc, t)."""
    from flashmemory.train.validate import score_rows

    cache: dict = {}

    def fn(doc, t: int) -> torch.Tensor:
        key = (doc.doc_index, t)
        if key not in cache:
            n = min(int(doc.n_chunks_at[t]), doc.n_chunks)
            s = score_rows(model, doc, torch.tensor([t]), torch.tensor([n]), "cpu")
            st = torch.stack([s[L][0, :n] for L in model.layers])
            cache[key] = st.amax(0) if ensemble == "max" else st.mean(0)
        return cache[key]

    return fn


def check_args(a: argparse.Namespace) -> None:
    """Range-check the numeric flags of every eval mode where they are read (UserError naming the flag)."""
    import math

    from flashmemory.errors import UserError

    at_least = {"tau": 1, "stride": 0, "gen_tokens": 1, "page_chunks": 1, "tail_chunks": 0, "kmax_pages": 1}
    for name, lo in at_least.items():
        v = getattr(a, name, lo)
        if v < lo:
            raise UserError(
                f"--{name.replace('_', '-')} {v}: must be >= {lo}" + (" (0 = tau)" if name == "stride" else "")
            )
    if not 0 <= a.seed < 2**32:  # mixed into 64-bit torch seeds per (doc, step)
        raise UserError(f"--seed {a.seed}: must lie in [0, 2**32)")
    if not (math.isfinite(a.threshold) and 0.0 <= a.threshold <= 1.0):
        raise UserError(f"--threshold {a.threshold}: must lie in [0, 1] (a sigmoid score)")
    budget = getattr(a, "budget", 0.25)
    if not 0.0 < budget <= 1.0:
        raise UserError(f"--budget {budget}: must lie in (0, 1] (a fraction of the pages)")
    parse_budgets(a.budgets)


def check_sizes(model, docs: list, paths: list, checkpoint: str) -> None:
    """Every document's hidden size and index-key width match the checkpoint's (CheckpointError naming both files):
    a retriever trained for another model cannot score these documents."""
    from flashmemory.retriever.checkpoint import CheckpointError

    d = model.dims
    for doc, p in zip(docs, paths):
        for L in model.layers:
            if L not in doc.hidden:
                raise CheckpointError(f"{checkpoint}: layer {L} is not dumped in {p} (it has {doc.target_layers})")
            hidden, width = int(doc.hidden[L].shape[-1]), int(doc.compk[L].shape[-1]) - 4
            if hidden != d.hidden or width != d.head_dim:
                raise CheckpointError(
                    f"{checkpoint}: retriever hidden size {d.hidden}, head dim {d.head_dim}; {p} "
                    f"layer {L} has hidden size {hidden}, index-key dim {width}: the checkpoint "
                    "was trained for another model"
                )


def run(a: argparse.Namespace) -> int:
    from flashmemory.errors import UserError, fail

    if a.checkpoint is None:  # not required by argparse only so that `eval quality` (no checkpoint) parses
        a.eval_parser.error("the following arguments are required: --checkpoint")
    try:
        check_args(a)
    except UserError as e:
        return fail("eval", e)
    if a.residency:
        from flashmemory.eval.residency_cli import run_residency

        return run_residency(a)
    if a.decode:
        from flashmemory.eval.decode_run import run_decode

        return run_decode(a)
    if bool(a.dump) == bool(a.data_config):
        print(
            "flashmemory eval: error: give exactly one of --dump or --data-config (or use --decode with --tasks)",
            file=sys.stderr,
        )
        return 2
    from flashmemory.dump.format import DumpFormatError, list_docs, load_doc
    from flashmemory.eval.evaluate import EvalConfig, evaluate, format_table, mass_note
    from flashmemory.eval.split import config_split_paths, heldout_paths
    from flashmemory.retriever.checkpoint import CheckpointError, load_retriever, read_state
    from flashmemory.train.data_config import DataConfigError

    try:
        model = load_retriever(a.checkpoint).eval()
        if a.data_config:
            paths, split_line = config_split_paths(a.data_config, a.split)
        else:
            paths, split_line = heldout_paths(list_docs(a.dump), read_state(a.checkpoint)[1], a.dump, a.all_docs)
        if a.doc_ids:
            try:
                want = {int(x) for x in a.doc_ids.split(",")}
            except ValueError:
                raise DumpFormatError(f"--doc-ids {a.doc_ids!r}: expected comma-separated integers") from None
            paths = [p for p in paths if int(p.stem.split("_")[1]) in want]
            missing = sorted(want - {int(p.stem.split("_")[1]) for p in paths})
            if missing:  # as for data-config doc_ids: never evaluate fewer documents than asked without a word
                raise DumpFormatError(
                    f"{a.dump or a.data_config}: --doc-ids {', '.join(map(str, missing))} have no "
                    f"complete document among the documents to score ({split_line})"
                )
        if not paths:
            raise DumpFormatError(
                f"{a.dump or a.data_config}: no documents to score ({split_line})"
                + (f" with ids {a.doc_ids}" if a.doc_ids else "")
                + ("; --all-docs scores training documents too" if a.dump else "")
            )
        docs = [load_doc(p, allow_pickle=a.allow_pickle) for p in paths]
        missing = [L for L in model.layers if L not in docs[0].hidden]
        if missing:
            raise CheckpointError(
                f"{a.checkpoint}: layers {missing} are not dumped in {a.dump} (it has {docs[0].target_layers})"
            )
        check_sizes(model, docs, paths, a.checkpoint)
        fractions = parse_budgets(a.budgets)
        cfg = EvalConfig(tau=a.tau, stride=a.stride, fractions=fractions, threshold=a.threshold, seed=a.seed)
    except (CheckpointError, DumpFormatError, DataConfigError, ValueError, OSError) as e:
        return fail("eval", e)
    print(split_line)
    res = evaluate(docs, retriever_scores(model, a.ensemble), cfg)
    n_mean = sum(
        min(int(d.n_chunks_at[t]), d.n_chunks) for d in docs for t in range(0, d.n_tokens, cfg.stride or cfg.tau)
    )
    n_rows = sum(len(range(0, d.n_tokens, cfg.stride or cfg.tau)) for d in docs)
    print(
        f"{len(docs)} docs, {n_rows} cycles, mean {n_mean / max(n_rows, 1):.1f} existing chunks per cycle; "
        f"tau {cfg.tau}, threshold {cfg.threshold}, ensemble {a.ensemble}"
    )
    print(format_table(res))
    print(
        "budget: fm@thr = FlashMemory's own count at its threshold, given to every policy; a number = that "
        "fraction of the existing chunks. mass: native top-k softmax mass on resident chunks; " + mass_note(docs)
    )
    if a.json:
        out = {"checkpoint": str(a.checkpoint), "dump": str(a.dump), "config": cfg.__dict__, "results": res}
        from flashmemory.atomic import atomic_write_text

        atomic_write_text(a.json, json.dumps(out, indent=1, default=float))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a retriever checkpoint against residency baselines on a dump",
        description="Policies (FlashMemory, recency, random, reactive, oracle) at equal resident "
        "budgets; golden recall, native top-k mass, resident fraction and pages.",
    )
    p.add_argument("--checkpoint", default=None, help="retriever checkpoint (.safetensors or .pt); required")
    p.add_argument("--dump", default=None, help="dump directory (flashmemory-dump/1); not with --decode")
    p.add_argument("--data-config", default=None, help="score one split of a training data config instead of --dump")
    p.add_argument(
        "--split",
        choices=("test", "val", "train"),
        default="test",
        help="with --data-config: the split to score (default %(default)s)",
    )
    p.add_argument(
        "--all-docs",
        action="store_true",
        help="with --dump: also score the documents the checkpoint "
        "was trained/selected on (default: held-out ones only)",
    )
    p.add_argument("--doc-ids", default=None, help="comma-separated doc indices (default: all of the split)")
    p.add_argument("--tau", type=int, default=64, help="lookahead window / cycle length (default %(default)s)")
    p.add_argument("--stride", type=int, default=0, help="decode steps between cycle starts; 0 = tau")
    p.add_argument("--budgets", default="0.1,0.25,0.5", help="fractions of existing chunks (default %(default)s)")
    p.add_argument("--threshold", type=float, default=0.5, help="FlashMemory sigmoid threshold (default %(default)s)")
    p.add_argument("--ensemble", choices=("max", "mean"), default="max", help="layer ensemble (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random-policy seed")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--allow-pickle", action="store_true", help="read upstream .pkl docs (runs pickled code)")
    from flashmemory.eval.decode_run import add_decode_args
    from flashmemory.eval.residency_cli import add_residency_args

    add_decode_args(p)
    add_residency_args(p)
    p.set_defaults(func=run, eval_parser=p)
    # Subcommands of eval: frontier here; `flashmemory eval quality` (flashmemory.demo.quality_cli) and
    # `flashmemory eval live` (flashmemory.eval.live.cli, a user of `flashmemory serve`) join the same set.
    from flashmemory.eval.frontier.cli import register_frontier

    p.fm_subcommands = p.add_subparsers(dest="eval_command", metavar="{quality,frontier,live}")
    register_frontier(p.fm_subcommands)
    # `flashmemory eval quality` drives the demo pipeline (a floor above eval): flashmemory.demo.quality_cli adds it.
