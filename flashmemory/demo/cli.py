"""`flashmemory demo`: the CPU end-to-end run (what `make demo` runs)."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from flashmemory.demo.config import (
    EXPECTED_SECONDS,
    EXPECTED_SERVE_SECONDS,
    SERVE_FIELDS,
    SERVE_STAGE,
    DemoConfig,
    preset,
)

HELP = {
    "model": "auto (the shipped trained model, else tiny-flash), a shipped random model (tiny-flash: 43-layer "
    "Flash pattern; micro: 9 layers) or a local checkpoint dir",
    "out_dir": "where tasks.jsonl, report.md, results.json, coverage.png, the dump and the checkpoint go (--quick: "
    "demo_out_quick, so it never replaces the full run's outputs); such files there that the demo did not "
    "write itself are first moved aside to NAME.bak-<time>",
    "seed": "seed of the model weights, the tasks and the random baseline",
    "doc_len": "prompt tokens per document",
    "gen_tokens": "decode steps per document",
    "n_train": "documents to train the retriever on",
    "n_val": "documents for checkpoint selection",
    "n_test": "held-out documents the table is measured on",
    "tau": "Level-1 interval in decode steps (64 when serving; short here because demo decodes are short)",
    "page_chunks": "chunks per page (64 when serving)",
    "budget": "page budget KMAX as a fraction of a document's pages, in (0, 1]; the same for every method",
    "tail_chunks": "recency tail in chunks, always resident",
    "threshold": "retriever score threshold (strict >)",
    "topp": "golden-label nucleus per layer",
    "min_layers": "layer votes a golden chunk needs",
    "epochs": "retriever training epochs",
    "n_heads": "retriever heads",
    "q_lora_rank": "retriever rank",
    "lr": "learning rate",
    "batch_size": "training batch size",
    "serve_kmax": "with --serve: resident pages (of 256 tokens) per request on the live decode server",
}


def register(sub: argparse._SubParsersAction) -> None:
    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="CPU end to end: tiny DeepSeek-V4 -> tasks -> golden labels -> train -> two-level recall",
        description="Runs the whole FlashMemory loop on CPU with a tiny seeded DeepSeek-V4 and prints one row per "
        "method (Full, FlashMemory, Recency, Random, Oracle, Reactive) at the same resident budget. "
        "Writes report.md, results.json and coverage.png to --out-dir. About 6 minutes on a quiet 2-core "
        "machine, --quick about 2; a stage running far slower than that is named with a warning.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny-flash with 512-token documents and fewer of them (about 2 minutes), into demo_out_quick/",
    )
    for f in fields(DemoConfig):
        if f.name not in HELP:
            continue
        default = getattr(d, f.name)
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(default),
            default=None,
            help=f"{HELP[f.name]} (default {default}; --quick may change it)",
        )
    p.add_argument("--tasks", default=None, help="comma-separated task names (default: all of the suite)")
    p.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    p.add_argument(
        "--serve",
        action="store_true",
        help="stage 7 (make demo passes it): start sglang's P, D (FlashMemory on) and the router on CPU "
        "with the serving-tiny model (random weights: sglang cannot serve the replay model's "
        "geometry) and a retriever trained for it, send chats through the router and report D's "
        "live FlashMemory counters beside the replay table (adds 3-6 minutes)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def config_from_args(a: argparse.Namespace) -> DemoConfig:
    cfg = preset(DemoConfig(), "quick" if a.quick else None)
    over = {
        f.name: getattr(a, f.name)
        for f in fields(DemoConfig)
        if f.name in HELP and getattr(a, f.name, None) is not None
    }
    if a.tasks:
        over["tasks"] = tuple(t.strip() for t in a.tasks.split(",") if t.strip())
    if a.no_plot:
        over["plot"] = False
    if getattr(a, "serve", False):
        over["serve"] = True
    return replace(cfg, **over)


def expected_seconds(cfg: DemoConfig, quick: bool) -> dict[str, float] | None:
    """Measured stage times for the preset `cfg` runs (stage 7 with `serve`), None once a flag changes the workload."""
    name = "quick" if quick else "full"
    keep = {k: getattr(cfg, k) for k in ("out_dir", "plot", "seed", *SERVE_FIELDS)}
    if cfg != replace(preset(DemoConfig(), "quick" if quick else None), **keep):
        return None
    return {**EXPECTED_SECONDS[name], **({SERVE_STAGE: EXPECTED_SERVE_SECONDS} if cfg.serve else {})}


def run(a: argparse.Namespace) -> int:
    from flashmemory.demo.pipeline import run_demo
    from flashmemory.errors import fail

    try:
        cfg = config_from_args(a)
    except ValueError as e:
        return fail("demo", e)
    user_set = {f.name for f in fields(DemoConfig) if f.name in HELP and getattr(a, f.name, None) is not None}
    results = run_demo(
        cfg,
        progress=not a.no_progress,
        expected=expected_seconds(cfg, a.quick),
        user_set=frozenset(user_set | ({"tasks"} if a.tasks else set())),
    )
    if "error" in results.get("serving", {}):  # stages 1-6 are reported; the run still failed
        return fail("demo", f"live serving (stage 7) failed: {results['serving']['error']}", code=1)
    return 0
