"""`flashmemory dump`: golden-label training data (upstream `run_dump_training_data.py` flags and defaults)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flashmemory import errors

DEFAULT_URL = "http://localhost:30000/v1"
MAX_SEED = 2**63 - 1  # torch seeds are 64-bit; the tiny models also seed a generator with seed + 1


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        required=True,
        help=".jsonl (upstream: `prompt` = JSON messages, optional `answer`) or a .json list of {prompt}",
    )
    p.add_argument("--output-dir", default="offline_retriever_data", help="dump directory (made absolute)")
    p.add_argument("--start-idx", type=int, default=0, help="first input item (0-based)")
    p.add_argument("--end-idx", type=int, default=None, help="stop before this input item")
    p.add_argument("--n-samples", type=int, default=None, help="at most this many items (after the slice)")
    p.add_argument("--thinking", action="store_true", help="thinking-mode chat template")
    p.add_argument("--topp", type=float, default=0.6, help="per-layer nucleus over the top-k softmax")
    p.add_argument("--min-layers", type=int, default=3, help="layer votes needed for a golden chunk")
    p.add_argument(
        "--target-csa-layers",
        type=int,
        nargs="+",
        default=None,
        metavar="L",
        help="c4-layer ids whose hidden/keys are saved (default 10 12 20; on a model with fewer c4 "
        "layers the last three, with a note)",
    )
    p.add_argument(
        "--store-topk",
        choices=("none", "cycle", "all"),
        default="cycle",
        help="store the native top-k (ids + logits) of every c4 layer for decode steps: cycle = every "
        "--topk-interval-th step, all = every step (large: T x k x 8 bytes per layer), none "
        "(default %(default)s)",
    )
    p.add_argument(
        "--topk-interval", type=int, default=64, help="step interval of --store-topk cycle (default %(default)s = tau)"
    )
    p.add_argument("--concurrency", type=int, default=4, help="pass-1 requests in flight (sglang backend)")
    p.add_argument("--batch-size", type=int, default=10, help="items per pass-1 / pass-2 / merge round")
    p.add_argument(
        "--backend",
        choices=("hf", "sglang"),
        default="hf",
        help="hf: in-process CPU engine; sglang: a dump-mode server at --url",
    )
    p.add_argument(
        "--model",
        default=None,
        help="hf: micro | tiny-flash | model dir (default micro); "
        "sglang: the served model name (default: $MODEL_PATH or 'default')",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="greedy tokens per item (default: 2048 for sglang, 32 for hf)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help=f"hf: seed of the random tiny model, in [0, {MAX_SEED}] (recorded in server_metadata.jsonl)",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read upstream doc_*.pkl when verifying (runs code from the file; trusted dumps only)",
    )
    p.add_argument("--url", default=None, help=f"sglang server (default $SGLANG_SERVER_URL or {DEFAULT_URL})")
    p.add_argument("--flush-timeout", type=float, default=60.0, help="sglang: seconds to wait for a doc file")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="hf: an item whose prompt + --max-tokens exceeds this fails alone (default 8192: the CPU "
        "engine's attention grows with the square of the length)",
    )
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="try again the items listed in <output-dir>/failed_items.jsonl (skipped by default)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show the traceback of an error instead of one line",
    )


def check_args(args: argparse.Namespace) -> None:
    """Range-check every numeric flag where it is read; a bad one is a ValueError naming the flag."""
    checks = [
        (0.0 <= args.topp <= 1.0, f"--topp {args.topp} must lie in [0, 1]"),
        (args.min_layers >= 1, f"--min-layers {args.min_layers} must be >= 1"),
        (args.topk_interval >= 1, f"--topk-interval {args.topk_interval} must be >= 1"),
        (args.start_idx >= 0, f"--start-idx {args.start_idx} must be >= 0"),
        (
            args.end_idx is None or args.end_idx > args.start_idx,
            f"--end-idx {args.end_idx} must be greater than --start-idx {args.start_idx}",
        ),
        (args.n_samples is None or args.n_samples >= 1, f"--n-samples {args.n_samples} must be >= 1 (omit it for all)"),
        (args.max_tokens is None or args.max_tokens >= 1, f"--max-tokens {args.max_tokens} must be >= 1"),
        (
            args.max_prompt_tokens is None or args.max_prompt_tokens >= 1,
            f"--max-prompt-tokens {args.max_prompt_tokens} must be >= 1",
        ),
        (args.concurrency >= 1, f"--concurrency {args.concurrency} must be >= 1"),
        (args.batch_size >= 1, f"--batch-size {args.batch_size} must be >= 1"),
        (args.flush_timeout > 0, f"--flush-timeout {args.flush_timeout} must be > 0"),
        (0 <= args.seed <= MAX_SEED, f"--seed {args.seed} must lie in [0, {MAX_SEED}] (2**63 - 1)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    if args.max_tokens is not None and args.max_prompt_tokens is not None and args.max_tokens >= args.max_prompt_tokens:
        raise ValueError(
            f"--max-tokens {args.max_tokens} leaves no room for a prompt under --max-prompt-tokens "
            f"{args.max_prompt_tokens}"
        )


def run(args: argparse.Namespace) -> int:
    """The dump command. Expected failures (bad flags, input, output dir, backend, a full disk) are one line on
    stderr and exit 2; items that failed make the exit 1; `--debug` shows the traceback instead."""
    from flashmemory.dump.backend import DumpBackendError
    from flashmemory.dump.errors import DumpFormatError, DumpOutputError
    from flashmemory.dump.inputs import InputError

    try:
        return _run(args)
    except (DumpBackendError, InputError, DumpFormatError, DumpOutputError, ValueError, OSError) as e:
        if getattr(args, "debug", False) or errors.debug():  # `flashmemory --debug dump` strips the flag
            raise
        return errors.fail("dump", e)


def _run(args: argparse.Namespace) -> int:
    from flashmemory.dump.backend import DumpBackendError, DumpConfig, resolve_target_layers
    from flashmemory.dump.client import load_selection, run_dump
    from flashmemory.dump.format import load_doc
    from flashmemory.dump.writer import DumpWriter

    check_args(args)
    out_dir = Path(args.output_dir).expanduser().resolve()
    load_selection(args.input, args.start_idx, args.end_idx, args.n_samples)  # input errors before any model load
    with DumpWriter(out_dir) as writer:  # output dir checked, locked and repaired before the first document
        for msg in writer.recovered:
            print(f"resume: {msg}", file=sys.stderr)
        if args.backend == "hf":
            from flashmemory.dump.hf_backend import HFBackend

            backend = HFBackend(args.model or "micro", seed=args.seed, thinking=args.thinking)
            max_tokens = args.max_tokens or 32
        else:
            from flashmemory.dump.sglang_backend import SGLangBackend

            url = args.url or os.environ.get("SGLANG_SERVER_URL", DEFAULT_URL)  # upstream's client variable
            backend = SGLangBackend(
                url,
                out_dir,
                model=args.model or os.environ.get("MODEL_PATH", "default"),
                concurrency=args.concurrency,
                thinking=args.thinking,
                flush_timeout=args.flush_timeout,
            )
            max_tokens = args.max_tokens or 2048
        layers, note = resolve_target_layers(args.target_csa_layers, backend.n_c4_layers)
        if note:
            print(note, file=sys.stderr)
        n_c4 = backend.n_c4_layers
        if n_c4 is not None and args.min_layers > n_c4:
            raise DumpBackendError(
                f"--min-layers {args.min_layers} exceeds the model's {n_c4} c4 layers: no chunk could ever be golden"
            )
        cfg = DumpConfig(
            topp=args.topp,
            min_layers=args.min_layers,
            target_layers=layers,
            max_tokens=max_tokens,
            thinking=args.thinking,
            store_topk=args.store_topk,
            topk_interval=args.topk_interval,
            max_prompt_tokens=args.max_prompt_tokens,
        )
        rep = run_dump(
            backend,
            args.input,
            out_dir,
            cfg,
            start_idx=args.start_idx,
            end_idx=args.end_idx,
            n_samples=args.n_samples,
            batch_size=args.batch_size,
            progress=not args.no_progress,
            writer=writer,
            retry_failed=args.retry_failed,
        )
        for p in sorted(out_dir.glob("doc_*.safetensors"))[-1:]:  # cheap self-check of the newest file
            load_doc(p, allow_pickle=args.allow_pickle)
    print(
        f"dumped {len(rep.committed)} document(s) to {out_dir} (target layers {' '.join(map(str, layers))}); "
        f"{rep.skipped_done} already done, "
        + (f"{len(rep.changed)} changed since an earlier dump (dumped again), " if rep.changed else "")
        + f"{len(rep.bad_input)} malformed input line(s) skipped, "
        f"{len(rep.failed)} item(s) failed"
        + (f", {len(rep.skipped_failed)} skipped as failed before" if rep.skipped_failed else "")
    )
    if rep.incomplete:
        print(
            f"error: {len(rep.failed) + len(rep.skipped_failed)} selected item(s) have no document (see the "
            f"messages above and {out_dir / 'failed_items.jsonl'})",
            file=sys.stderr,
        )
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dump", help="dump golden-label training data (hf CPU engine or a dump-mode sglang server)", description=__doc__
    )
    add_args(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="run_dump_training_data.py", description=__doc__)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
