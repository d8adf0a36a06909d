"""`flashmemory bench serve`: decode tokens/s of the live sglang server on CPU, stock vs FlashMemory, one run.

Two PD stacks through the launch scripts (DEVICE=cpu, the tiny serving model), one after the other in the same
run: D stock (FLASHMEMORY=0), then D with FlashMemory (Path-P, shrink mode, score-resident Level 2) at a page
budget of about 10% of the history (KMAX pages of 64 c4 chunks, a one-page recency tail). Each gets the same
workload: `--requests` concurrent greedy requests (random token ids, EOS ignored) with contexts spread over
`--contexts`, streamed through the router so every token's arrival is timed on the client. Read:
- decode tok/s: tokens after each request's first / (last token of any request - first token of any request);
- ITL: mean inter-token gap per request, averaged;
- the ratio FlashMemory / stock of both: the hooks' overhead on this machine (CPU: the "device" is host memory,
  so recall costs memory bandwidth, not PCIe; the ratio is the figure, not the absolute numbers);
- FlashMemory's own counters from D's /metrics (resident fraction, cycles, recalled bytes).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
from pathlib import Path

from flashmemory.atomic import atomic_write_text
from flashmemory.bench.guard import int_list
from flashmemory.errors import UserError, fail
from flashmemory.serve.client import StreamResult, flashmemory_metrics, generate, generate_stream
from flashmemory.serve.procs import Servers, ServerStartError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="contexts 512-1024, 4 steady tokens (a smoke run)")
    p.add_argument("--requests", type=int, default=4, help="concurrent requests (default 4)")
    p.add_argument("--contexts", default="1024,4096", help="min,max prompt tokens, spread over the requests")
    p.add_argument(
        "--tokens",
        type=int,
        default=1024,
        help="most decode tokens per request (default 1024; a stream stops earlier, see --steady-tokens)",
    )
    p.add_argument(
        "--steady-tokens",
        type=int,
        default=32,
        help="tokens each request decodes once all are decoding, then its stream stops (default 32)",
    )
    p.add_argument("--kmax", type=int, default=1, help="resident pages (64 c4 chunks) per request (default 1)")
    p.add_argument(
        "--ckpt",
        default="auto",
        help="retriever checkpoint for Level 1; 'auto' (default) trains one for "
        "the served model first (about a minute), '' runs recency only",
    )
    p.add_argument("--model", default="", help="serving model dir (default: the tiny one, built if missing)")
    p.add_argument("--out", default="", help="write the result as JSON here too")
    p.add_argument("--logs", default="", help="server logs dir (default: a temp dir)")


def contexts(lo: int, hi: int, n: int) -> list[int]:
    """`n` prompt lengths evenly spread over [lo, hi] (one request each)."""
    if n == 1:
        return [hi]
    return [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


def summarize(results: list[StreamResult]) -> dict[str, float]:
    """Aggregate decode tokens/s and mean inter-token latency of concurrent streamed requests.

    steady_tok_s: tokens that arrived while every request was decoding (after the last first token, up to the
    first request's last token) per second of that window: on PD over one CPU the prefill server's work for the
    later requests falls inside the wider decode_tok_s window and is the same for both arms, which dilutes a
    ratio of the two; the steady window holds decode alone. NaN when the requests never all decode at once."""
    t0 = min(r.first for r in results)
    t1 = max(r.last for r in results)
    lo, hi = max(r.first for r in results), min(r.last for r in results)
    steady = sum(lo < t <= hi for r in results for t in r.token_times)
    decoded = sum(r.n_tokens - 1 for r in results)
    itls = [(r.last - r.first) / (r.n_tokens - 1) for r in results if r.n_tokens > 1]
    return {
        "decode_tok_s": decoded / (t1 - t0) if t1 > t0 else float("nan"),
        "steady_tok_s": steady / (hi - lo) if hi > lo else float("nan"),
        "steady_window_s": max(0.0, hi - lo),
        "itl_ms": 1e3 * sum(itls) / len(itls) if itls else float("nan"),
        "ttft_s": sum(r.first - r.sent for r in results) / len(results),
        "wall_s": t1 - min(r.sent for r in results),
    }


def _concurrent(url: str, prompts: list[list[int]], tokens: int, steady_tokens: int) -> list[StreamResult]:
    """Stream every prompt at once. Once all of them are decoding, each stream stops after `steady_tokens` more
    tokens (`tokens` is only the upper bound): on 2 cores the prefills run one after another, so without this the
    first requests finish before the last one starts and no step ever decodes all of them together."""
    n = len(prompts)
    out: list[StreamResult | BaseException | None] = [None] * n
    lock, started, all_in = threading.Lock(), set(), [float("inf")]

    def stop_after_steady(i: int):
        def stop(times: list[float]) -> bool:
            with lock:
                if i not in started:  # the first chunk may bring more than one token
                    started.add(i)
                    if len(started) == n:
                        all_in[0] = times[0]
                t0 = all_in[0]
            return sum(t > t0 for t in times) >= steady_tokens

        return stop

    done = [0]

    def one(i: int) -> None:
        try:
            out[i] = generate_stream(url, prompts[i], tokens, stop=stop_after_steady(i))
        except BaseException as e:  # re-raised below, in the caller's thread
            out[i] = e
        with lock:
            done[0] += 1
            print(f"  request {i} ({len(prompts[i])} tokens) finished: {done[0]}/{n}", flush=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out  # type: ignore[return-value]


def run_arm(
    fm: bool,
    model: Path,
    prompts: list[list[int]],
    tokens: int,
    kmax: int,
    ckpt: str,
    logs: Path,
    steady_tokens: int = 32,
) -> dict:
    from flashmemory.serve.stack import PDConfig, start_pd

    ctx = max(len(p) for p in prompts) + tokens + 256
    knobs = {"CTX_LEN": str(ctx), "MAX_RUN": str(max(4, len(prompts)))}
    decode_env = dict(knobs, KMAX=str(kmax), LAST_KEEP="64", INTERVAL="16", CKPT=ckpt)
    cfg = PDConfig(model=model, flashmemory=fm, decode_env=decode_env, prefill_env=knobs)
    arm = "flashmemory" if fm else "stock"
    print(f"arm {arm}: starting P, D and the router (1-3 minutes on 2 cores; logs {logs / arm}) ...", flush=True)
    with Servers(logs / arm) as servers:
        stack = start_pd(servers, cfg)
        print(
            f"arm {arm}: ready ({', '.join(f'{k} {v:.0f} s' for k, v in stack.startup_s.items())}); "
            f"streaming {len(prompts)} requests ...",
            flush=True,
        )
        generate(stack.router_url, prompts[0][:16], 2)  # warm the path once (not timed)
        res = summarize(_concurrent(stack.router_url, prompts, tokens, steady_tokens))
        res["startup_s"] = stack.startup_s
        res["metrics"] = flashmemory_metrics(stack.decode_url) if fm else {}
    if servers.leftovers():
        raise RuntimeError(f"processes left behind: {servers.leftovers()}")
    return res


def run(args: argparse.Namespace) -> int:
    from flashmemory.serve.stack import DEFAULT_CPU_MODEL, ensure_model

    bounds = [512, 1024] if args.quick else int_list(args.contexts, "--contexts", 1, 1 << 20)
    if len(bounds) != 2 or bounds[0] > bounds[1]:
        raise UserError(f"--contexts {args.contexts!r}: expected MIN,MAX prompt tokens with MIN <= MAX, e.g. 1024,4096")
    lo, hi = bounds
    tokens = args.tokens
    if args.quick:
        args.steady_tokens = min(args.steady_tokens, 4)
    if args.steady_tokens < 1:
        raise UserError(f"--steady-tokens {args.steady_tokens}: must be >= 1")
    if args.requests < 1 or tokens < 2:
        raise UserError(f"--requests {args.requests} / --tokens {tokens}: need --requests >= 1, --tokens >= 2")
    model = ensure_model(Path(args.model) if args.model else DEFAULT_CPU_MODEL)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    lens = contexts(lo, hi, args.requests)
    prompts = [[rng.randrange(32, vocab) for _ in range(n)] for n in lens]  # past the special tokens
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="fm_bench_serve_"))
    ckpt = args.ckpt
    if ckpt == "auto":
        from flashmemory.serve.tiny_retriever import train_tiny_retriever

        print(f"bench serve: training a retriever for {model} (about a minute) ...", flush=True)
        ckpt = str(train_tiny_retriever(model, logs / "retriever"))
    print(
        f"bench serve: {args.requests} concurrent requests, contexts {lens}, {tokens} tokens each; "
        f"KMAX {args.kmax} page(s); retriever {ckpt or 'none (recency only)'}; logs {logs}",
        flush=True,
    )
    try:
        stock = run_arm(False, model, prompts, tokens, args.kmax, ckpt, logs, args.steady_tokens)
        fm = run_arm(True, model, prompts, tokens, args.kmax, ckpt, logs, args.steady_tokens)
    except (ServerStartError, RuntimeError, OSError) as e:
        return fail("bench serve", f"{str(e).splitlines()[0] if str(e) else type(e).__name__} (logs {logs})", 1)
    ratio = fm["decode_tok_s"] / stock["decode_tok_s"]
    steady = fm["steady_tok_s"] / stock["steady_tok_s"]
    m = fm["metrics"]
    print(f"{'':14s}{'decode tok/s':>14s}{'steady tok/s':>14s}{'window s':>10s}{'ITL ms':>10s}{'TTFT s':>10s}")
    for name, r in (("stock", stock), ("FlashMemory", fm)):
        print(
            f"{name:14s}{r['decode_tok_s']:14.2f}{r['steady_tok_s']:14.2f}{r['steady_window_s']:10.1f}"
            f"{r['itl_ms']:10.1f}{r['ttft_s']:10.1f}"
        )
    print(
        f"ratio FlashMemory / stock decode tok/s: {ratio:.3f} (hooks' overhead {100 * (1 - ratio):+.1f}%); "
        f"all {len(prompts)} decoding: {steady:.3f}"
    )
    print(
        "FlashMemory counters on D: resident fraction {:.3f}, Level-1 cycles {:.0f}, pages recalled {:.0f}, "
        "recalled bytes {:.0f}".format(
            m.get("flashmemory_resident_fraction", float("nan")),
            m.get("flashmemory_level1_cycles_total", float("nan")),
            m.get("flashmemory_recall_pages_total", float("nan")),
            m.get("flashmemory_recall_bytes_total", float("nan")),
        )
    )
    if args.out:
        atomic_write_text(
            args.out,
            json.dumps(
                {
                    "stock": stock,
                    "flashmemory": fm,
                    "ratio": ratio,
                    "steady_ratio": steady,
                    "contexts": lens,
                    "tokens": tokens,
                },
                indent=1,
            ),
        )
    return 0
