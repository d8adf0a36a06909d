"""`flashmemory serve` (what `make serve` runs): P, D and the router on CPU with the tiny model, until Ctrl-C.

It builds the tiny serving model if it is missing, starts the PD stack through the launch scripts (DEVICE=cpu),
prints the router URL and an example request, and then waits. Ctrl-C (or SIGTERM / SIGHUP) stops all three
servers as process groups, then removes the disk-tier page stores (SGLANG_PATHP_DISK_DIR) that its killed
schedulers could not remove themselves, only theirs; a server that dies stops the others and the command exits
1. One machine-readable line, `READY {json}`, says where everything is (the live tests read it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from flashmemory.errors import UserError, describe, fail
from flashmemory.serve.procs import Servers, ServerStartError

EXAMPLE = """\
FlashMemory PD stack on CPU (tiny model: random weights, so the text is noise; it is for trying things out)
  router   {router}   (OpenAI-compatible: {router}/v1/chat/completions)
  prefill  {prefill}
  decode   {decode}   (FlashMemory: {fm}; live counters at {decode}/metrics, flashmemory_*)
  Level 1  {ckpt}
  logs     {logs}
Try:
  curl -s {router}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "default", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}'
  python -c "from openai import OpenAI; c = OpenAI(base_url='{router}/v1', api_key='none'); \\
print(c.chat.completions.create(model='default', messages=[{{'role': 'user', 'content': 'Hello'}}], max_tokens=16))"
Ctrl-C stops all three."""


class _Stop(KeyboardInterrupt):
    """SIGINT / SIGTERM / SIGHUP: stop. A KeyboardInterrupt, so one that lands before the servers start (while the
    model or the retriever is built) ends the command in one line with exit 130 (`flashmemory.cli.main`)."""


def _raise_stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    from flashmemory.serve.stack import PDConfig, ensure_model, ensure_retriever, hisparse_config, start_pd

    if args.ckpt not in ("auto", "none") and not Path(args.ckpt).is_file():
        return fail("serve", f"--ckpt {args.ckpt}: no such file (or 'auto', 'none')")
    from flashmemory.serve.validate import check_port, check_timeout

    check_timeout(args.startup_timeout, "--startup-timeout")  # before the model or retriever is built
    check_port(args.port, PDConfig.host, "--port")
    # SIGINT too: a process started in the background of a script (or by a test runner's worker) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler, so Ctrl-C / kill -INT would do nothing
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    from flashmemory.hf.serving_build import BuildError

    try:
        model = ensure_model(Path(args.model))
    except OSError as e:  # e.g. a parent that is a file, or not writable: name the flag, not a lock file
        raise UserError(
            f"--model {args.model}: no serving model there, and one cannot be built there ({describe(e)})"
        ) from e
    except BuildError as e:  # something else is there (a file, another build): the builder's reason, our flag
        raise UserError(f"--model {describe(e).replace('choose another --out', 'choose another --model')}") from e
    stock = args.stock or args.hisparse
    ckpt = "" if stock or args.ckpt == "none" else str(ensure_retriever(model)) if args.ckpt == "auto" else args.ckpt
    decode_env = {"CKPT": ckpt} if ckpt else {}
    cfg = PDConfig(model=model, flashmemory=not stock, decode_env=decode_env, startup_timeout=args.startup_timeout)
    if args.hisparse:
        cfg = hisparse_config(cfg)
    servers = Servers(Path(args.logs))
    try:
        print("starting decode + prefill, then the router (about 1-3 minutes on 2 cores) ...", flush=True)
        stack = start_pd(servers, cfg, router_port=args.port or None)
        print(
            EXAMPLE.format(
                router=stack.router_url,
                prefill=stack.prefill_url,
                decode=stack.decode_url,
                fm="off (sglang's HiSparse)" if args.hisparse else "off (stock)" if stock else "on",
                logs=args.logs,
                ckpt=ckpt or "off (no retriever)",
            ),
            flush=True,
        )
        print(
            "READY "
            + json.dumps(
                {
                    "router": stack.router_url,
                    "prefill": stack.prefill_url,
                    "decode": stack.decode_url,
                    "pgids": sorted(servers.pgids()),
                    "startup_s": {k: round(v, 1) for k, v in stack.startup_s.items()},
                }
            ),
            flush=True,
        )
        while True:
            for p in servers.procs:
                if p.popen.poll() is not None:
                    print(p.log_tail(), file=sys.stderr)
                    return fail("serve", f"{p.name} exited with {p.popen.returncode}; log {p.log} (its tail above)", 1)
            time.sleep(1.0)
    except ServerStartError as e:
        head, _, tail = str(e).partition("\n")
        if tail:
            print(tail, file=sys.stderr)  # the server's log tail, above the one error line
        return fail("serve", head + (" (its tail above)" if tail else ""), 1)
    except (KeyboardInterrupt, _Stop):
        print("stopping ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        swept = servers.stop()
        left = servers.leftovers()
        print("stopped: all servers gone" if not left else f"warning: still running: {left}", flush=True)
        if swept:  # page stores of schedulers that had to be killed (they remove their own when they can)
            print(f"removed {len(swept)} page store(s) its stopped servers left: {', '.join(swept)}", flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    from flashmemory.serve.stack import DEFAULT_CPU_MODEL

    p = sub.add_parser(
        "serve",
        help="P, D and the router on CPU with the tiny model (Ctrl-C stops them)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=str(DEFAULT_CPU_MODEL), help="serving model dir (built if missing)")
    p.add_argument(
        "--ckpt",
        default="auto",
        help="retriever checkpoint for Level 1 on D; 'auto' (default): one trained for the served model, "
        "built once beside it (about a minute) like the model; 'none': no Level 1, the recency "
        "tail alone decides what is resident",
    )
    p.add_argument("--port", type=int, default=31503, help="router port (0: any free port; default 31503)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--stock", action="store_true", help="D without FlashMemory (stock sglang decode)")
    kind.add_argument(
        "--hisparse",
        action="store_true",
        help="D as sglang's own HiSparse (--enable-hisparse, a 512-slot hot buffer per c4 layer and "
        "request, KV over Mooncake TCP) instead of FlashMemory: the peer to compare with",
    )
    p.add_argument("--logs", default="serve_logs", help="server logs directory (default serve_logs/)")
    p.add_argument("--startup-timeout", type=float, default=420.0, help="seconds each server may take to start")
    p.set_defaults(func=run)
