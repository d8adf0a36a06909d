"""`flashmemory bench tier`: the disk tier's recall path against the host-only one, side by side in one run.

1. One request's recall of K pages (one Level-1 cycle; `--turnover` of its resident set is new, 1.0 = worst
   case): disk -> host page cache -> reserve (read-ahead by `HostPageCache` with `--readers` threads, cold cache)
   vs host -> reserve (the pages already in DRAM, the host-only FlashMemory path); latency, bandwidth, ratio.
2. c requests recalling in the same cycle, c = `--conc`: the time of all c recalls and its share of the tau
   window (tau x `--step-ms`, a stated decode-step time, not measured here); then, from the bandwidth measured
   at the largest c, the concurrency at which one cycle's recalls stop fitting in the window.
3. The store's write bandwidth (write-behind of the same pages).
4. Host DRAM of the host mirror at `--context` tokens per request and each c: one slot per page (no disk tier)
   against the landing window (SGLANG_PATHP_HOST_MIRROR_GB at its floor), as the engine sizes them
   (`offload.tiered_mirror.window_slots`): computed from the geometry, not measured. The host page cache
   (SGLANG_PATHP_HOST_CACHE_GB) comes on top of the window.

A page is the real DeepSeek-V4-Flash disk page (all c4 layers' KV rows + Path-I index-K rows, 938,304 B) unless
`--layers` says otherwise. The store lives in `--dir` (default: a temp dir, removed after); O_DIRECT is used where
the filesystem allows, otherwise the OS page cache is dropped (fsync + POSIX_FADV_DONTNEED) before each read.

Before any allocation the host memory (`planned_bytes`) and the disk space the run needs are checked against what
is available; a page the store could not take (a full disk) stops the run with one line naming --dir instead of
timing host memory as if it were the disk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from flashmemory.bench.guard import require_disk, require_memory
from flashmemory.bench.tier_store import check_written, close_store, store_dir
from flashmemory.env import DiskTierConfig
from flashmemory.errors import UserError
from flashmemory.offload.disk import HostPageCache, PageStore, disk_page_bytes
from flashmemory.offload.engine import EngineConfig
from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.tiered_mirror import window_slots


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="16 pages per request, concurrency 1 2 4, one repeat")
    p.add_argument("--pages", type=int, default=0, help="pages recalled per request and cycle (0 = 16 quick, else 96)")
    p.add_argument(
        "--conc", type=int, nargs="+", default=None, help="concurrent requests (default 1 2 4, 1 2 4 8 full)"
    )
    p.add_argument("--turnover", type=float, default=1.0, help="share of a request's pages new per cycle (for the fit)")
    p.add_argument("--readers", type=int, default=4, help="read-ahead threads of the host page cache")
    p.add_argument("--tau", type=int, default=64, help="decode steps per Level-1 cycle")
    p.add_argument(
        "--step-ms",
        type=float,
        default=30.0,
        help="stated decode-step time in ms, the window being tau x this (default 30: upstream's measured "
        "steps are 24-30 ms)",
    )
    p.add_argument("--layers", type=int, default=21, help="c4 layers in a page (Path-I index rows for all but 3)")
    p.add_argument(
        "--context",
        type=int,
        default=1048576,
        help="tokens per request for the host-mirror DRAM lines (default 1,048,576)",
    )
    p.add_argument("--reps", type=int, default=0, help="repeats per timing, best kept (0 = 1 quick, else 3)")
    p.add_argument("--dir", default="", help="directory for the page store (default: a new temp dir, removed after)")
    p.add_argument("--no-direct", action="store_true", help="buffered I/O even where O_DIRECT works")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the reserve lives")
    p.add_argument("--json", metavar="PATH", help="also write every number as JSON (atomic)")


def _fs_type(path: str) -> str:
    """Filesystem type of the mount holding `path` (Linux /proc/mounts), or 'unknown'."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if (
                    len(parts) > 2
                    and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/"))
                    and len(parts[1]) >= len(best)
                ):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _best(fn: Callable[[], None], reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _check(args: argparse.Namespace) -> None:
    if args.pages < 1 or min(args.conc) < 1 or args.readers < 1 or args.tau < 1 or args.reps < 1 or args.layers < 4:
        raise UserError("--pages, --conc, --readers, --tau, --reps must be >= 1 and --layers >= 4")
    if not (args.step_ms > 0 and math.isfinite(args.step_ms)) or not 0 < args.turnover <= 1:
        raise UserError("--step-ms must be a positive number and --turnover lie in (0, 1]")
    if args.context < 4:
        raise UserError("--context must be >= 4 tokens (one c4 chunk)")
    if args.dir and not os.path.isdir(args.dir):
        raise UserError(f"--dir {args.dir!r} is not an existing directory")
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        raise UserError(f"--device {args.device!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: no CUDA device here (use --device cpu)")


def planned_bytes(args: argparse.Namespace) -> dict[str, int]:
    """What `measure` will allocate: `host` bytes of host memory (the source pages, the staging copy, the host page
    cache and, on CPU, the reserve) and `disk` bytes of page store, from --pages x max(--conc) pages of
    --layers' page size."""
    lay = OffloadLayout(n_layers=args.layers, target_layers=(args.layers - 3, args.layers - 2, args.layers - 1))
    pb = disk_page_bytes(lay)
    n = args.pages * max(args.conc)
    copies = 3 + (torch.device(args.device).type == "cpu")
    return {"host": copies * n * pb, "disk": (n + 8) * (pb + 8192)}


def mirror_dram(layout: OffloadLayout, context: int, conc: int) -> dict[str, int]:
    """Host mirror bytes for `conc` requests of `context` tokens: `full` (one DRAM slot per page, the mirror without
    a disk tier) and `window` (the landing window at its floor, the smallest SGLANG_PATHP_HOST_MIRROR_GB takes), as
    `window_slots` sizes them. A slot holds one disk page (`disk_page_bytes`)."""
    pb = disk_page_bytes(layout)
    cfg = EngineConfig(max_rows=conc, max_chunks=-(-context // 4))
    pages = conc * layout.pages_for(cfg.max_chunks)
    slots = window_slots(DiskTierConfig(dir="/", host_mirror_gb=1e-9), layout, cfg)
    return {
        "conc": conc,
        "pages": pages,
        "full_bytes": pages * pb,
        "window_slots": slots or pages,
        "window_bytes": (slots or pages) * pb,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the measurements; returns every number (bytes, seconds, ratios) in one dict."""
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    lay = OffloadLayout(n_layers=args.layers, target_layers=(args.layers - 3, args.layers - 2, args.layers - 1))
    pb, k, cmax = disk_page_bytes(lay), args.pages, max(args.conc)
    n = k * cmax
    d, own = store_dir(args.dir, "fm-bench-tier-")
    pin = dev.type == "cuda"
    host = torch.empty((n, pb), dtype=torch.uint8, pin_memory=pin).random_(0, 256)
    staging = torch.empty((n, pb), dtype=torch.uint8, pin_memory=pin)
    reserve = torch.empty((n, pb), dtype=torch.uint8, device=dev)
    hnp, snp = host.numpy(), staging.numpy()
    store = PageStore(
        d, (n + 8) * (pb + 8192), pb, direct=not args.no_direct, what="--dir", size_what="--pages x --conc"
    )
    cache = HostPageCache(store, (n + 1) * pb, readers=args.readers)
    out: dict[str, Any] = {
        "page_bytes": pb,
        "pages_per_request": k,
        "readers": args.readers,
        "dir": d,
        "filesystem": _fs_type(d),
        "o_direct": store.direct,
        "fallback": store.fallback_reason,
        "device": str(dev),
        "tau": args.tau,
        "step_ms": args.step_ms,
        "turnover": args.turnover,
    }
    try:
        t = time.perf_counter()
        for i in range(n):
            cache.put(f"req{i // k}", i % k, memoryview(hnp[i]))
        check_written(cache, d, n, "; the timings would measure host memory, not the disk")
        if not store.direct:
            os.fsync(store.fd)
        out["write_gbps"] = n * pb / (time.perf_counter() - t) / 1e9

        def cold() -> None:
            cache.drop_clean()
            if not store.direct:
                os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)

        rows = []
        for c in sorted(args.conc):
            m = c * k

            def host_path(m: int = m) -> None:  # m, c bound per concurrency
                reserve[:m].copy_(host[:m], non_blocking=True)
                sync()

            def disk_path(c: int = c, m: int = m) -> None:
                for r in range(c):
                    cache.prefetch(f"req{r}", list(range(k)))
                for i in range(m):
                    snp[i] = np.frombuffer(cache.get(f"req{i // k}", i % k), dtype=np.uint8)
                reserve[:m].copy_(staging[:m], non_blocking=True)
                sync()

            host_path()
            t_host = _best(host_path, args.reps)
            t_disk = math.inf
            for _ in range(args.reps):
                cold()
                t_disk = min(t_disk, _best(disk_path, 1))
            if not torch.equal(reserve[:m].cpu(), host[:m]):
                raise RuntimeError("bench tier: the pages recalled from disk differ from the pages written")
            window = args.tau * args.step_ms / 1e3
            rows.append(
                {
                    "conc": c,
                    "bytes": m * pb,
                    "host_s": t_host,
                    "disk_s": t_disk,
                    "host_gbps": m * pb / t_host / 1e9,
                    "disk_gbps": m * pb / t_disk / 1e9,
                    "ratio": t_disk / t_host,
                    "disk_window_share": args.turnover * t_disk / window,
                    "host_window_share": args.turnover * t_host / window,
                }
            )
        out["rows"] = rows
        out["counters"] = cache.counters.as_dict()
        last = rows[-1]
        per_req = args.turnover * k * pb
        window = args.tau * args.step_ms / 1e3
        out["fit_conc_disk"] = math.floor(window * last["disk_gbps"] * 1e9 / per_req)
        out["fit_conc_host"] = math.floor(window * last["host_gbps"] * 1e9 / per_req)
        out["context"] = args.context
        out["mirror_dram"] = [mirror_dram(lay, args.context, c) for c in sorted(args.conc)]
    finally:
        close_store(cache, store, d, own)
    return out


def report(r: dict[str, Any]) -> None:
    mode = "O_DIRECT" if r["o_direct"] else f"buffered ({r['fallback'] or 'OS cache dropped before each read'})"
    print(
        f"disk tier recall: {r['pages_per_request']} pages x {r['page_bytes']:,} B per request, store on "
        f"{r['filesystem']} ({mode}), {r['readers']} read-ahead threads, reserve on {r['device']}"
    )
    print(f"store write (write-behind): {r['write_gbps']:.2f} GB/s")
    window_ms = r["tau"] * r["step_ms"]
    print(f"tau window = {r['tau']} x {r['step_ms']:g} ms (stated) = {window_ms:,.0f} ms; turnover {r['turnover']:g}")
    print(
        f"{'conc':>5} {'MB':>8} {'host->res ms':>13} {'disk->host->res ms':>19} {'host GB/s':>10} "
        f"{'disk GB/s':>10} {'disk/host':>10} {'window: disk':>13} {'host':>7}"
    )
    for x in r["rows"]:
        print(
            f"{x['conc']:>5} {x['bytes'] / 1e6:>8.1f} {x['host_s'] * 1e3:>13.2f} {x['disk_s'] * 1e3:>19.2f} "
            f"{x['host_gbps']:>10.2f} {x['disk_gbps']:>10.2f} {x['ratio']:>9.1f}x "
            f"{x['disk_window_share']:>12.1%} {x['host_window_share']:>7.1%}"
        )
    c = r["counters"]
    print(
        f"cache: hit rate {c['hit_rate']:.2f}, read-ahead late {c['readahead_late']}, disk read "
        f"{c['disk_bytes_read'] / 1e9:.2f} GB, written {c['disk_bytes_written'] / 1e9:.2f} GB"
    )
    print(
        f"stops fitting: at the bandwidth of the last row one window holds the recalls of {r['fit_conc_disk']} "
        f"requests from disk, {r['fit_conc_host']} from host DRAM (this machine; a per-node NVMe array: "
        "`flashmemory bench costmodel`, disk arm)"
    )
    print(
        f"host mirror DRAM at {r['context']:,} tokens per request (computed from the geometry, as the engine sizes "
        "it; the host page cache comes on top of the window):"
    )
    for m in r["mirror_dram"]:
        print(
            f"{m['conc']:>5} requests: one slot per page {m['full_bytes'] / 1e9:,.2f} GB ({m['pages']:,} pages); "
            f"landing window {m['window_bytes'] / 1e6:,.1f} MB ({m['window_slots']:,} slots)"
        )


def run(args: argparse.Namespace) -> int:
    args.pages = args.pages or (16 if args.quick else 96)
    args.conc = args.conc or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    args.reps = args.reps or (1 if args.quick else 3)
    _check(args)
    return measure_checked(args, planned_bytes(args), "--pages x --conc x the page size of --layers", measure, report)


def measure_checked(
    args: argparse.Namespace,
    need: dict[str, int],
    memory_what: str,
    measure_fn: Callable[[argparse.Namespace], dict],
    report_fn: Callable[[dict], None],
) -> int:
    """A disk bench's run once its flags are checked: host memory and disk space (`need["host"]`, `need["disk"]`
    bytes) refused in one line before any work, then measure, print, and write `--json` atomically."""
    require_memory(need["host"], memory_what)
    require_disk(args.dir or tempfile.gettempdir(), need["disk"], "--dir")
    r = measure_fn(args)
    report_fn(r)
    if args.json:
        from flashmemory.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(r, indent=1))
        print(f"wrote {args.json}")
    return 0
