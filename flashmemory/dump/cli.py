"""`flashmemory dump`: golden-label training data (upstream `run_dump_training_data.py` flags and defaults)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_URL = "http://localhost:30000/v1"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help=".jsonl (upstream: `prompt` = JSON messages, optional `answer`) "
                                                  "or a .json list of {prompt}")
    p.add_argument("--output-dir", default="offline_retriever_data", help="dump directory (made absolute)")
    p.add_argument("--start-idx", type=int, default=0, help="first input item (0-based)")
    p.add_argument("--end-idx", type=int, default=None, help="stop before this input item")
    p.add_argument("--n-samples", type=int, default=None, help="at most this many items (after the slice)")
    p.add_argument("--thinking", action="store_true", help="thinking-mode chat template")
    p.add_argument("--topp", type=float, default=0.6, help="per-layer nucleus over the top-k softmax")
    p.add_argument("--min-layers", type=int, default=3, help="layer votes needed for a golden chunk")
    p.add_argument("--target-csa-layers", type=int, nargs="+", default=None, metavar="L",
                   help="c4-layer ids whose hidden/keys are saved (default 10 12 20; on a model with fewer c4 "
                        "layers the last three, with a note)")
    p.add_argument("--store-topk", choices=("none", "cycle", "all"), default="cycle",
                   help="store the native top-k (ids + logits) of every c4 layer for decode steps: cycle = every "
                        "--topk-interval-th step, all = every step (large: T x k x 8 bytes per layer), none "
                        "(default %(default)s)")
    p.add_argument("--topk-interval", type=int, default=64, help="step interval of --store-topk cycle "
                                                                   "(default %(default)s = tau)")
    p.add_argument("--concurrency", type=int, default=4, help="pass-1 requests in flight (sglang backend)")
    p.add_argument("--batch-size", type=int, default=10, help="items per pass-1 / pass-2 / merge round")
    p.add_argument("--backend", choices=("hf", "sglang"), default="hf",
                   help="hf: in-process CPU engine; sglang: a dump-mode server at --url")
    p.add_argument("--model", default=None, help="hf: micro | tiny-flash | model dir (default micro); "
                                                 "sglang: the served model name (default: $MODEL_PATH or 'default')")
    p.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per item (default: 2048 for "
                                                                "sglang, 32 for hf)")
    p.add_argument("--seed", type=int, default=0, help="hf: seed of the random tiny model")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read upstream doc_*.pkl when verifying (runs code from the file; trusted dumps only)")
    p.add_argument("--url", default=None, help=f"sglang server (default $SGLANG_SERVER_URL or {DEFAULT_URL})")
    p.add_argument("--flush-timeout", type=float, default=60.0, help="sglang: seconds to wait for a doc file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from flashmemory.dump.backend import DumpBackendError, DumpConfig, resolve_target_layers
    from flashmemory.dump.client import run_dump
    from flashmemory.dump.format import DumpFormatError, load_doc
    from flashmemory.dump.inputs import InputError

    out_dir = Path(args.output_dir).expanduser().resolve()
    if not 0.0 <= args.topp <= 1.0:
        print(f"error: --topp {args.topp} must lie in [0, 1]", file=sys.stderr)
        return 2
    if args.min_layers < 1:
        print(f"error: --min-layers {args.min_layers} must be >= 1", file=sys.stderr)
        return 2
    if args.topk_interval < 1:
        print(f"error: --topk-interval {args.topk_interval} must be >= 1", file=sys.stderr)
        return 2
    try:
        if args.backend == "hf":
            from flashmemory.dump.hf_backend import HFBackend
            backend = HFBackend(args.model or "micro", seed=args.seed, thinking=args.thinking)
            max_tokens = args.max_tokens or 32
        else:
            from flashmemory.dump.sglang_backend import SGLangBackend
            url = args.url or os.environ.get("SGLANG_SERVER_URL", DEFAULT_URL)  # upstream's client variable
            backend = SGLangBackend(url, out_dir, model=args.model or os.environ.get("MODEL_PATH", "default"),
                                    concurrency=args.concurrency, thinking=args.thinking,
                                    flush_timeout=args.flush_timeout)
            max_tokens = args.max_tokens or 2048
        layers, note = resolve_target_layers(args.target_csa_layers, backend.n_c4_layers)
        if note:
            print(note, file=sys.stderr)
        n_c4 = backend.n_c4_layers
        if n_c4 is not None and args.min_layers > n_c4:
            raise DumpBackendError(f"--min-layers {args.min_layers} exceeds the model's {n_c4} c4 layers: "
                                   "no chunk could ever be golden")
        cfg = DumpConfig(topp=args.topp, min_layers=args.min_layers, target_layers=layers,
                         max_tokens=max_tokens, thinking=args.thinking, store_topk=args.store_topk,
                         topk_interval=args.topk_interval)
        rep = run_dump(backend, args.input, out_dir, cfg, start_idx=args.start_idx, end_idx=args.end_idx,
                       n_samples=args.n_samples, batch_size=args.batch_size, progress=not args.no_progress)
        for p in sorted(out_dir.glob("doc_*.safetensors"))[-1:]:  # cheap self-check of the newest file
            load_doc(p, allow_pickle=args.allow_pickle)
    except (DumpBackendError, InputError, DumpFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"dumped {len(rep.committed)} document(s) to {out_dir} (target layers {' '.join(map(str, layers))}); "
          f"{rep.skipped_done} already done, {len(rep.bad_input)} malformed input line(s) skipped, "
          f"{len(rep.failed)} item(s) failed")
    return 1 if rep.failed and not rep.committed else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dump", help="dump golden-label training data (hf CPU engine or a dump-mode sglang server)",
                       description=__doc__)
    add_args(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="run_dump_training_data.py", description=__doc__)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
