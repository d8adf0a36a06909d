"""`flashmemory eval live`: argument parsing and the command (`eval.live.run`)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

DESCRIPTION = """\
The task suite served live: for each arm, a P + D + router stack on 127.0.0.1 (`flashmemory serve`'s), the replay
frontier's documents sent through the router with the OpenAI client (/v1/completions, a text prompt built with the
task tokenizer, greedy, ignore_eos), the answers scored with the task scorer. Arms: stock; FlashMemory at each
--budgets share of the pages (KMAX = ceil(budget x pages of 256 tokens)); HiSparse and HiSparse+prefetch with a hot
buffer of the same chunks (at least the model's top-k). Each document's record is written as it finishes (one per
arm and document, fingerprinted by the model, the arm's settings and the document's content); rerun the same
command to continue. Every stack is started and held under the live-server lock (--lock, the file `flock` takes),
handed back after --hold-minutes and taken again for the arm's remaining documents. Writes live.md and live.json
to --out (locked while it runs), beside the --replay run's numbers for the same documents. On 2 cores a stack
starts in 30-70 s and a 4K-token document takes about a minute."""


def _env_pairs(raw: list[str] | None) -> tuple[tuple[str, str], ...]:
    from flashmemory.errors import UserError

    out = []
    for x in raw or []:
        k, sep, v = x.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise UserError(f"--server-env {x!r}: expected NAME=VALUE (an environment variable for P and D)")
        out.append((k, v))
    return tuple(out)


def config_from_args(a: argparse.Namespace):
    """LiveConfig from the parsed flags (UserError naming a bad flag or file)."""
    from flashmemory.errors import UserError
    from flashmemory.eval.budgets import parse_budgets
    from flashmemory.eval.live.arms import parse_arms
    from flashmemory.eval.live.run import DEFAULT_TASKS, LiveConfig
    from flashmemory.eval.records import check_n_per_task, check_tasks, name_list
    from flashmemory.tasks.suite import TASKS

    budgets = parse_budgets(a.budgets)
    if not budgets:
        raise UserError(f"--budgets {a.budgets!r}: give at least one fraction in (0, 1]")
    check_n_per_task(a.n_per_task)
    tasks = name_list(a.tasks) or DEFAULT_TASKS
    check_tasks(tasks, tuple(TASKS), "the suite's")
    for flag, v, lo in (("--doc-len", a.doc_len, 64), ("--gen-tokens", a.gen_tokens, 1), ("--tau", a.tau, 1)):
        if v < lo:
            raise UserError(f"{flag} {v}: must be >= {lo}")
    for flag, v in (("--tail-chunks", a.tail_chunks), ("--first-doc", a.first_doc), ("--seed", a.seed)):
        if v < 0:
            raise UserError(f"{flag} {v}: must be >= 0")
    if not 0.0 <= a.threshold <= 1.0:
        raise UserError(f"--threshold {a.threshold}: must lie in [0, 1]")
    if not a.hold_minutes > 0:
        raise UserError(f"--hold-minutes {a.hold_minutes}: must be > 0")
    if a.max_docs is not None and a.max_docs < 0:
        raise UserError(f"--max-docs {a.max_docs}: must be >= 0")
    if a.replay and not (Path(a.replay) / "docs").is_dir():
        raise UserError(f"--replay {a.replay}: no replay frontier run there (no docs/ folder); '' for none")
    return LiveConfig(
        out_dir=a.out,
        model=a.model,
        arms=parse_arms(a.arms, budgets),
        retriever=a.retriever,
        n_per_task=a.n_per_task,
        tasks=tasks,
        doc_len=a.doc_len,
        gen_tokens=a.gen_tokens,
        tau=a.tau,
        threshold=a.threshold,
        tail_chunks=a.tail_chunks,
        first_doc=a.first_doc,
        seed=a.seed,
        server_env=_env_pairs(a.server_env),
        replay=a.replay,
        replay_retriever=a.replay_retriever,
        replay_tokens=a.replay_tokens,
        replay_first_plan=a.replay_first_plan,
        lock=a.lock,
        hold_s=a.hold_minutes * 60.0,
        max_docs=0 if a.report_only else a.max_docs,
        replace=a.replace,
        c4_mode=a.c4_mode,
        startup_timeout=a.startup_timeout,
        logs=a.logs,
        budgets=budgets,
    )


def served_model(model: Path, server_env: dict[str, str]) -> Path:
    """`model` checked as `flashmemory serve` checks it, with the window the servers will attend (the CPU layer's
    window row, when --server-env sets it); `flashmemory serve`'s default model is built if missing."""
    from flashmemory.errors import UserError
    from flashmemory.serve.model_check import WINDOW_VAR, check_serving_model
    from flashmemory.serve.stack import ensure_model

    if not (model / "config.json").is_file():
        return ensure_model(model)
    raw = server_env.get(WINDOW_VAR, "0") or "0"
    try:
        window = int(raw)
    except ValueError:
        raise UserError(f"--server-env {WINDOW_VAR}={raw}: expected a whole number of tokens") from None
    return check_serving_model(model, swa_window=window)


def retriever_layers(path: str) -> tuple[int, ...]:
    """The c4 layers a retriever checkpoint reads (Level 1's LAYERS on D); () without one."""
    if not path:
        return ()
    from flashmemory.retriever.checkpoint import load_retriever

    return tuple(int(x) for x in load_retriever(path).layers)


def run(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from flashmemory.errors import UserError, describe, fail
    from flashmemory.eval.live.run import run_live
    from flashmemory.eval.live.stack import StackSettings, open_session
    from flashmemory.serve.procs import ServerStartError
    from flashmemory.serve.stack import ensure_retriever

    try:
        cfg = config_from_args(a)
        model = served_model(Path(cfg.model), dict(cfg.server_env))
        needs_l1 = any(x.kind in ("FlashMemory", "HiSparse+prefetch") for x in cfg.arms)
        retriever = cfg.retriever
        if retriever == "auto":
            retriever = str(ensure_retriever(model)) if needs_l1 else ""
        elif retriever and not Path(retriever).is_file():
            raise UserError(f"--retriever {retriever}: no such file (or 'auto')")
        cfg = replace(cfg, model=str(model), retriever=retriever)
        import json

        topk = int(json.loads((model / "config.json").read_text(encoding="utf-8")).get("index_topk", 512))
        st = StackSettings(
            model=model,
            retriever=retriever,
            server_env=dict(cfg.server_env),
            context_len=cfg.context_len(),
            doc_len=cfg.doc_len,
            index_topk=topk,
            tau=cfg.tau,
            threshold=cfg.threshold,
            tail_chunks=cfg.tail_chunks,
            retriever_layers=retriever_layers(retriever),
            c4_mode=cfg.c4_mode,
            startup_timeout=cfg.startup_timeout,
            logs=Path(cfg.logs) if cfg.logs else Path(cfg.out_dir) / "logs",
        )
        run_live(cfg, lambda arm: open_session(arm, st, cfg.lock), print)
    except ServerStartError as e:
        head, _, tail = str(e).partition("\n")
        if tail:
            print(tail)
        return fail("eval live", head + (" (its log tail above)" if tail else ""), 1)
    except (UserError, OSError) as e:
        return fail("eval live", e)
    except KeyboardInterrupt:
        return fail("eval live", "interrupted; the finished documents are kept, rerun to continue", 130)
    except Exception as e:  # a request the server answered with an error: one line, the records so far are kept
        from flashmemory.errors import debug

        if debug():
            raise
        return fail("eval live", f"{type(e).__name__}: {describe(e)}", 1)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `live` as a subcommand of `flashmemory eval` (registered before this, by `flashmemory.eval.cli`). The
    command starts `flashmemory serve` stacks, so it sits a floor above serve, not in eval's own CLI."""
    register_live(subparsers.choices["eval"].fm_subcommands)


def register_live(sub: argparse._SubParsersAction) -> None:
    """Add `live` to `flashmemory eval`'s subcommands."""
    from flashmemory.eval.live.arms import C4_MODES
    from flashmemory.serve.stack import DEFAULT_CPU_MODEL, REPO

    replay = REPO / "docs" / "quality" / "frontier_run_budget"
    p = sub.add_parser(
        "live",
        help="the task suite through live sglang stacks (stock, FlashMemory, HiSparse), beside the replay; resumable",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="live_out", help="output dir (default %(default)s)")
    p.add_argument("--model", default=str(DEFAULT_CPU_MODEL), help="served model dir (default: `flashmemory serve`'s)")
    p.add_argument(
        "--retriever",
        default="auto",
        help="Level-1 checkpoint for FlashMemory and HiSparse+prefetch; 'auto' (default): the one `flashmemory serve` "
        "trains beside the served model",
    )
    p.add_argument(
        "--arms", default="stock,FlashMemory", help="stock,FlashMemory,HiSparse,HiSparse+prefetch (default %(default)s)"
    )
    p.add_argument("--budgets", default="0.1,0.2", help="page shares of the non-stock arms (default %(default)s)")
    p.add_argument("--n-per-task", type=int, default=8, help="documents per task (default %(default)s)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default niah_single,niah_multikey,mqar)")
    p.add_argument("--doc-len", type=int, default=4096, help="prompt tokens per document (default %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=24, help="tokens decoded per document (default %(default)s)")
    p.add_argument("--tau", type=int, default=16, help="Level-1 interval in decode steps (default %(default)s)")
    p.add_argument("--threshold", type=float, default=0.5, help="Level-1 score threshold (default %(default)s)")
    p.add_argument("--tail-chunks", type=int, default=8, help="Level-1 recency tail in c4 chunks (default %(default)s)")
    p.add_argument("--first-doc", type=int, default=8, help="index of the first document (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="document seeds are seed * 1000 + index (default 0)")
    p.add_argument(
        "--server-env",
        action="append",
        metavar="NAME=VALUE",
        help="environment for P and D, e.g. a CPU-layer row's gate (repeatable; part of the fingerprint)",
    )
    p.add_argument(
        "--replay",
        default=str(replay) if (replay / "docs").is_dir() else "",
        help="the replay frontier run to compare with (default: the committed "
        "docs/quality/frontier_run_budget; '' for none)",
    )
    p.add_argument(
        "--replay-retriever",
        default=str(REPO / "docs" / "quality" / "frontier_retriever.safetensors"),
        help="the replay's retriever, for --replay-tokens (default %(default)s)",
    )
    p.add_argument(
        "--replay-tokens",
        action="store_true",
        help="recompute the replay's tokens per document (the shipped model, ~10 s a document, cached in --out) "
        "to find the first token where live and replay part",
    )
    p.add_argument(
        "--replay-first-plan",
        choices=("prompt", "full", "recency"),
        default="prompt",
        help="how --replay-tokens starts a request: prompt (default, as the published frontier: a step-0 plan on "
        "the prompt's last position), full (as live copy mode: every chunk until the first plan, made on the first "
        "decode position), recency (as live shrink mode: the warm start until then)",
    )
    p.add_argument(
        "--lock",
        default="/tmp/fm-live.lock",
        help="the live-server lock file, taken per stack (default %(default)s); do not also wrap the command in "
        "`flock` on the same file (the two would wait for each other); '' takes none",
    )
    p.add_argument("--hold-minutes", type=float, default=10.0, help="hand the lock back after this long (default 10)")
    p.add_argument(
        "--max-docs", type=int, default=None, help="run at most this many new documents per arm, then report"
    )
    p.add_argument("--startup-timeout", type=float, default=420.0, help="seconds each server may take to start")
    p.add_argument("--logs", default="", help="server logs dir (default --out/logs)")
    p.add_argument("--report-only", action="store_true", help="start nothing; report the documents already done")
    p.add_argument(
        "--c4-mode",
        choices=C4_MODES,
        default="copy",
        help="FlashMemory's Path-P mode on D (default %(default)s: sglang's pool keeps every page, so a request "
        "attends its whole history until its first Level-1 plan; shrink: the warm start alone until then)",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="run again and overwrite a document whose record has another configuration (default: stop there)",
    )
    p.set_defaults(func=run)
