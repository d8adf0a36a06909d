"""`flashmemory bench peers`: stock, sglang's HiSparse, HiSparse+prefetch (Level 1's hints copied into HiSparse's
hot buffer), FlashMemory and FlashMemory+miss monitor on the same requests in one run, live on CPU.

The arms' PD stacks start at once (`peers_live`; HiSparse and HiSparse+prefetch once per hot-buffer size given to
--hisparse-buffer), then the arms are interleaved per round: for each repeat, for each context, the arms in turn,
so the shared box's load falls on all of them alike. A round streams `--requests` concurrent greedy requests of
`--contexts[i]` random tokens (the same prompts for every arm) and reads, per arm:
- counted costs per decode token from D's /metrics (counter deltas over the round; `peers_costs`): host -> device
  bytes on the critical path (on-demand) and prefetched ahead of it, the hot buffer's hit rate, transfer
  operations, c4 entries moved, c4 entries scored over all c4 layers;
- device-resident bytes per request of the c4 attention state (c4 KV / index-K / reserve or hot buffer), from the
  config and, for FlashMemory, its measured page budget;
- tokens equal to the stock arm's in the same round (greedy; common prefix of each stream);
- as signs only: steady decode tok/s (the window in which all requests decode), its ratio to stock in the same
  round, ITL, and sglang's own per-step decode time from D's log.
A steady window that does not open in any (round, context, arm) makes the bench say which and exit 1.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from flashmemory.atomic import atomic_write_text
from flashmemory.bench.guard import require_memory
from flashmemory.bench.peers_costs import (
    ARMS,
    MAX_CONTEXT,
    Knobs,
    PeersArgError,
    arm_label,
    check_args,
    decode_step_ms,
    delta,
    device_bytes,
    parse_arms,
    parse_buffers,
    parse_contexts,
    per_token_costs,
    pool_tokens,
    shape_from_config,
    spread,
    steady_failures,
    tokens_equal,
)
from flashmemory.bench.peers_report import plain, summarize
from flashmemory.bench.serve import summarize as timing
from flashmemory.errors import UserError, fail
from flashmemory.serve.client import flashmemory_metrics
from flashmemory.serve.procs import ServerStartError

QUICK_CONTEXTS = "2304"
DEFAULT_CONTEXTS = "2048,4096,8192"
INTERVAL = 16  # Level-1 tau, as bench serve runs it


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"contexts {QUICK_CONTEXTS}, 2 requests, 1 repeat, 8 steady tokens (a smoke run of a few minutes)",
    )
    p.add_argument("--contexts", default=None, help=f"prompt lengths, increasing (default {DEFAULT_CONTEXTS})")
    p.add_argument("--requests", type=int, default=None, help="concurrent requests per round (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="rounds per context and arm (default 2)")
    p.add_argument(
        "--steady-tokens", type=int, default=None, help="tokens each request decodes once all are decoding (default 48)"
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=512,
        help="most decode tokens per request (default 512; streams stop earlier, see --steady-tokens; "
        "it must outlast the other requests' prefills, and D's pool grows with it)",
    )
    p.add_argument("--kmax", type=int, default=2, help="FlashMemory's resident pages of 64 c4 entries (default 2)")
    p.add_argument(
        "--hisparse-buffer",
        default="576,640",
        help="HiSparse hot-buffer slots per c4 layer per request, one or two sizes (default 576,640; "
        "the HiSparse and HiSparse+prefetch arms run at each; the prefetch needs more than top-k)",
    )
    p.add_argument("--arms", default=",".join(ARMS), help=f"arms to run, stock among them (default {','.join(ARMS)})")
    p.add_argument(
        "--ckpt",
        default="auto",
        help="retriever checkpoint for Level 1; 'auto' (default): the one "
        "trained for the served model (once, about a minute)",
    )
    p.add_argument("--model", default="", help="serving model dir (default: the tiny one, built if missing)")
    p.add_argument("--out", default="", help="write the result as JSON here too (atomically)")
    p.add_argument("--logs", default="", help="server logs dir (default: a temp dir)")


def _settings(args: argparse.Namespace) -> tuple[list[int], int, int, int]:
    quick = bool(args.quick)
    ctxs = parse_contexts(
        args.contexts if args.contexts is not None else (QUICK_CONTEXTS if quick else DEFAULT_CONTEXTS)
    )
    requests = args.requests if args.requests is not None else 2
    repeats = args.repeats if args.repeats is not None else (1 if quick else 2)
    steady = args.steady_tokens if args.steady_tokens is not None else (8 if quick else 48)
    return ctxs, requests, repeats, steady


def _round(
    arm: str, stack, prompts: list[list[int]], ctx: int, steady: int, max_new: int, shape, knobs: Knobs, d_log
) -> tuple[dict, list[list[int]]]:
    """One arm, one context: stream the prompts, read D's counters before and after; the round's record."""
    from flashmemory.bench.peers_live import GaugeSampler, concurrent_round

    before = flashmemory_metrics(stack.decode_url)
    log_at = len(d_log.log_text())
    with GaugeSampler(stack.decode_url, len(prompts)) as g:
        got = concurrent_round(stack, prompts, max_new, steady)
    d = delta(before, flashmemory_metrics(stack.decode_url))
    tokens = sum(s.result.n_tokens - 1 for s in got)  # D's tokens: the first one comes from P
    rec = dict(timing([s.result for s in got]), arm=arm, ctx=ctx, tokens=tokens, counters=d)
    res = spread(g.resident)["median"] if g.resident else None
    budget = spread(g.budget)["median"] if g.budget else None
    rec.update(
        resident_fraction=res,
        budget_pages=budget,
        costs=per_token_costs(arm, d, max(tokens, 1), ctx, shape, knobs, res),
        device=device_bytes(arm, ctx, shape, knobs, budget),
        step_ms=decode_step_ms(d_log.log_text()[log_at:], len(prompts)),
    )
    return rec, [s.ids for s in got]


def _terminate(signum: int, frame) -> None:
    """SIGTERM: leave through the `finally` blocks that stop every server (the default handler left 6 behind)."""
    raise SystemExit(128 + signum)


def _write(path: str, settings: dict, rounds: list[dict], complete: bool) -> None:
    """The run's JSON (atomically): settings, the per (context, arm) summary and every round's record."""
    atomic_write_text(
        path,
        json.dumps(
            {"complete": complete, "settings": settings, "summary": summarize(rounds), "rounds": rounds},
            indent=1,
            default=float,
        ),
    )


def run(args: argparse.Namespace) -> int:
    from flashmemory.serve.stack import DEFAULT_CPU_MODEL, ensure_model, ensure_retriever

    try:
        ctxs, requests, repeats, steady = _settings(args)
        check_args(requests, repeats, args.kmax, steady)
        arms = parse_arms(args.arms)
        if not steady + 1 <= args.tokens <= MAX_CONTEXT:
            raise PeersArgError(
                f"--tokens {args.tokens}: must exceed --steady-tokens ({steady}) and be at most {MAX_CONTEXT:,}"
            )
        # the prompts are built as Python lists before any server starts: about 36 B per token id
        require_memory(36 * requests * sum(ctxs), "bench peers: --contexts x --requests")
        model = ensure_model(Path(args.model) if args.model else DEFAULT_CPU_MODEL)
        cfg = json.loads((model / "config.json").read_text())
        shape = shape_from_config(cfg)
        buffers = parse_buffers(args.hisparse_buffer, shape.index_topk, "hs_prefetch" in arms)
        if ctxs[0] // shape.c4_ratio < 4 * buffers[-1]:
            print(
                f"note: context {ctxs[0]} has {ctxs[0] // shape.c4_ratio} c4 entries, less than 4x the "
                f"{buffers[-1]}-slot hot buffer: the buffer is under little pressure there",
                flush=True,
            )
    except UserError as e:
        return fail("bench peers", e)
    ckpt = str(ensure_retriever(model)) if args.ckpt == "auto" else args.ckpt
    knobs = Knobs(kmax=args.kmax, interval=INTERVAL, retriever_layers=2, hot_buffer=buffers[0])
    # an upper bound only: each stream stops `steady` tokens after all requests decode. It must outlast the
    # other requests' prefills (minutes each on a loaded box), or the first request ends before the last starts
    max_new = args.tokens
    ctx_len = ctxs[-1] + max_new + 256
    max_total = pool_tokens(ctxs[-1], max_new, requests)
    rng = random.Random(0)
    vocab = int(cfg["vocab_size"])
    prompts = {c: [[rng.randrange(32, vocab) for _ in range(c)] for _ in range(requests)] for c in ctxs}
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="fm_bench_peers_"))
    from flashmemory.bench.peers_live import arm_setups, start_all, stop_all

    setups = arm_setups(
        model, ctx_len, max_total, max(4, requests), args.kmax, ckpt, buffers, shape.index_topk, INTERVAL, tuple(arms)
    )
    keys = [s.arm for s in setups]
    n_p = len({s.cfg.transfer_backend for s in setups})
    print(
        f"bench peers: arms {', '.join(arm_label(k) for k in keys)}; contexts {ctxs}, {requests} requests, "
        f"{repeats} repeat(s), {steady} steady tokens; KMAX {args.kmax}, HiSparse buffer(s) {buffers}; "
        f"pool {max_total} tokens; logs {logs}",
        flush=True,
    )
    print(
        f"starting {n_p} P server(s) (NIXL; Mooncake for HiSparse) and {len(keys)} D servers at once (several "
        "minutes on 2 cores) ...",
        flush=True,
    )
    t_start = time.monotonic()
    signal.signal(signal.SIGTERM, _terminate)  # `kill` stops the servers too (the finally blocks below)
    try:
        servers, stacks = start_all(setups, logs)
    except (ServerStartError, RuntimeError, OSError) as e:
        return fail("bench peers", f"{str(e).splitlines()[0]} (logs {logs})", 1)
    rounds, outs = [], {}
    settings = {
        "contexts": ctxs,
        "requests": requests,
        "repeats": repeats,
        "steady_tokens": steady,
        "kmax": args.kmax,
        "hisparse_buffers": buffers,
        "arms": keys,
        "interval": INTERVAL,
        "pool_tokens": max_total,
        "ckpt": ckpt,
        "model": str(model),
        "shape": vars(shape),
    }
    try:
        from flashmemory.bench.peers_live import stream_ids

        for arm in keys:  # warm each path once (not counted)
            stream_ids(stacks[arm], prompts[ctxs[0]][0][:16], 2, lambda t: False)
        total, k = repeats * len(ctxs) * len(keys), 0
        for rep in range(repeats):
            for ctx in ctxs:
                for arm in keys:
                    k += 1
                    print(
                        f"[{k}/{total}] round {rep + 1}, context {ctx}, {arm_label(arm)} ... "
                        f"({time.monotonic() - t_start:.0f} s)",
                        flush=True,
                    )
                    d_log = next(p for p in servers.procs if p.name == f"decode_{arm}")
                    rec, ids = _round(arm, stacks[arm], prompts[ctx], ctx, steady, max_new, shape, knobs, d_log)
                    rec["round"] = rep
                    outs[(rep, ctx, arm)] = ids
                    eq, cmp = tokens_equal(outs[(rep, ctx, "stock")], ids)
                    rec.update(eq=eq, cmp=cmp)
                    rounds.append(rec)
                    if args.out:  # after every round: a run stopped early still leaves what it measured
                        _write(args.out, settings, rounds, complete=False)
                    print(
                        f"    steady {rec['steady_tok_s']:.2f} tok/s over {rec['steady_window_s']:.1f} s, "
                        f"{rec['tokens']} decode tokens, tokens = stock {eq}/{cmp}",
                        flush=True,
                    )
    except (RuntimeError, OSError) as e:
        return fail("bench peers", f"{' '.join(str(e).splitlines())} (logs {logs})", 1)
    finally:
        left = stop_all(servers)
        if left:
            print(f"warning: processes left behind: {left}", file=sys.stderr)
    rows = summarize(rounds)
    print("\n" + plain(rows))
    print("\nCounted costs are per decode token (hardware-independent); timing is a sign only (2 shared cores).")
    if args.out:
        _write(args.out, settings, rounds, complete=True)
        print(f"wrote {args.out}")
    bad = steady_failures(rounds)
    for line in bad:
        fail("bench peers", line, 1)
    return 1 if bad else 0
