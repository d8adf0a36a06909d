"""`flashmemory model train-tiny | probe`: train the tiny retrieval DeepSeek-V4 and measure how it retrieves."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from flashmemory.errors import describe
from flashmemory.tiny.train import TrainTinyConfig

TRAIN_HELP = {
    "out_dir": "output directory (model/, trainer.pt, metrics.jsonl); an existing run there is resumed",
    "model": "shipped config name or .json config of the fresh model",
    "init_from": "checkpoint directory whose weights start a new run (fresh optimizer and schedule)",
    "seed": "seed of the weights and of the training documents",
    "steps": "maximum optimizer steps",
    "time_budget_s": "stop after this much training time (0 = none); the schedule is scaled to it",
    "tokens_per_step": "tokens per batch (batch size = this // document length)",
    "lr": "peak learning rate (AdamW)",
    "min_lr_frac": "final learning rate as a fraction of the peak (cosine)",
    "warmup": "warm-up steps",
    "weight_decay": "AdamW weight decay",
    "kl_weight": "weight of the indexer KL loss",
    "hca_drop": "probability of dropping each c128 entry while training (pushes retrieval onto c4)",
    "tasks": "training task mix, comma-separated",
    "lengths": "curriculum document lengths, comma-separated",
    "length_until": "progress (0-1) at which each length but the last ends, comma-separated",
    "sparse_from": "progress from which c4 attention uses the config's index top-k (dense before)",
    "device": "auto, cpu, cuda or cuda:N",
    "workers": "document-generation processes (0 = inline)",
    "eval_every": "steps between held-out evaluations",
    "eval_docs": "held-out documents per evaluation (at the last length)",
    "ckpt_every_s": "seconds between checkpoints",
    "log_every": "steps between metrics.jsonl lines",
}


def _tuple(kind):
    def parse(s: str):
        try:
            return tuple(kind(x) for x in s.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {s!r}") from None

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "model",
        help="train-tiny (a tiny DeepSeek-V4 that retrieves) | probe (how it retrieves) | "
        "build-serving (the tiny checkpoint sglang serves on CPU) | pad (the trained one in sglang's geometry)",
    )
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    t = msub.add_parser(
        "train-tiny", help="train DeepseekV4ForCausalLM on the long-context retrieval curriculum", description=__doc__
    )
    d = TrainTinyConfig()
    for f in fields(TrainTinyConfig):
        if f.name not in TRAIN_HELP:
            continue
        default = getattr(d, f.name)
        kind = _tuple(type(default[0])) if isinstance(default, tuple) else type(default)
        t.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=default,
            help=f"{TRAIN_HELP[f.name]} (default {default})",
        )
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t.add_argument("--debug", action="store_true", help="show tracebacks")
    t.set_defaults(func=run_train)
    from flashmemory.tiny.probe_cli import add_probe_parser

    add_probe_parser(msub)
    from flashmemory.hf.serving_build import add_build_serving

    add_build_serving(msub)
    from flashmemory.hf.pad_build import add_pad
    from flashmemory.tiny.shipped import trained_model_dir

    add_pad(msub, str(trained_model_dir()))
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def run_train(a: argparse.Namespace) -> int:
    from flashmemory.tiny.train import train_tiny

    kw = {f.name: getattr(a, f.name) for f in fields(TrainTinyConfig) if f.name in TRAIN_HELP}
    try:
        cfg = TrainTinyConfig(**kw, progress=not a.no_progress)
        summary = train_tiny(cfg)
    except (ValueError, RuntimeError, OSError, FloatingPointError) as e:
        if a.debug:
            raise
        print(f"flashmemory model train-tiny: error: {describe(e)}", file=sys.stderr)
        return 2
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})
    return 0
