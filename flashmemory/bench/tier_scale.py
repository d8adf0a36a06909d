"""`flashmemory bench tier-scale`: the disk tier with many requests whose pages exceed the host page cache.

`--requests` requests each hold `--pages` pages on disk (the real DeepSeek-V4-Flash disk page unless `--layers`
says otherwise), written behind through a `HostPageCache` of `--cache-gb` (default: a quarter of all the pages, so
the history does not fit in the tier's DRAM). Then `--cycles` Level-1 cycles: each request's plan names `--kmax`
pages, of which `--turnover` are new (drawn from its other pages) and the rest were recalled the cycle before.
Per cycle, as the tiered engine does: read-ahead (`prefetch`) of every request's picks, `--lead-ms` of wall time
(0: the copy starts right after the read-ahead is queued, as the core does today; more: read-ahead started that
much earlier), then each request's recall copy gets its pages in order (a page not in DRAM waits for its read).

Counted with the engine's definitions: a page is a cache hit when it is in DRAM at its get; read-ahead is issued
for a pick not in DRAM at plan time, and it hit when the page was in DRAM by its get; a recall waited for disk when
one of its gets found its page not in DRAM (`TieredEngine.recalls_waited`), and a cycle waited when one of its
recalls did. `readahead_late` is the cache's own counter. The store is read with O_DIRECT where the filesystem
allows it (the OS page cache holds nothing then; otherwise it is dropped before the cycles), so the machine's
DRAM does not hide the disk. Timings are this machine's; the counts depend on them (read-ahead races the copy).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from flashmemory.bench.tier_store import check_written, close_store, store_dir
from flashmemory.errors import UserError
from flashmemory.offload.disk import HostPageCache, PageStore, disk_page_bytes
from flashmemory.offload.layout import OffloadLayout

SLOT_SLACK = 8192  # per-slot header and alignment a store adds to a page (bench tier uses the same bound)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="8 requests x 16 pages of a 4-layer page, 3 cycles, lead 0")
    p.add_argument("--requests", type=int, default=0, help="requests with pages on disk (0 = 8 quick, else 32)")
    p.add_argument("--pages", type=int, default=0, help="pages each request holds on disk (0 = 16 quick, else 64)")
    p.add_argument("--kmax", type=int, default=0, help="pages each request recalls per cycle (0 = 4 quick, else 8)")
    p.add_argument(
        "--turnover",
        type=float,
        default=0.5,
        help="share of a request's picks that are new each cycle (default 0.5; 1.0 = worst case)",
    )
    p.add_argument("--cycles", type=int, default=0, help="Level-1 cycles per run (0 = 3 quick, else 6)")
    p.add_argument(
        "--cache-gb",
        type=float,
        default=0.0,
        help="host page cache, GB (SGLANG_PATHP_HOST_CACHE_GB; default 0 = a quarter of all the pages)",
    )
    p.add_argument("--readers", type=int, default=4, help="read-ahead threads of the host page cache (default 4)")
    p.add_argument(
        "--lead-ms",
        type=float,
        nargs="+",
        default=None,
        help="wall time between queuing a cycle's read-ahead and its copy, one run each (default 0 1000; quick 0)",
    )
    p.add_argument("--tau", type=int, default=64, help="decode steps per Level-1 cycle (default 64)")
    p.add_argument(
        "--step-ms",
        type=float,
        default=30.0,
        help="stated decode-step time, ms; the window is tau x this (default 30, not measured here)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="c4 layers in a page, Path-I index rows for all but 3 (0 = 4 quick, else 21: the real page)",
    )
    p.add_argument("--dir", default="", help="directory for the page store (default: a temp dir, removed after)")
    p.add_argument("--no-direct", action="store_true", help="buffered I/O instead of O_DIRECT")
    p.add_argument("--seed", type=int, default=0, help="seed of the picks (default 0)")
    p.add_argument("--json", metavar="PATH", help="also write every number as JSON (atomic)")


def _defaults(a: argparse.Namespace) -> None:
    q = a.quick
    a.requests = a.requests or (8 if q else 32)
    a.pages = a.pages or (16 if q else 64)
    a.kmax = a.kmax or (4 if q else 8)
    a.cycles = a.cycles or (3 if q else 6)
    a.layers = a.layers or (4 if q else 21)
    a.lead_ms = a.lead_ms if a.lead_ms is not None else ([0.0] if q else [0.0, 1000.0])


def _check(a: argparse.Namespace) -> None:
    for name in ("requests", "pages", "kmax", "cycles", "readers", "tau"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name} {getattr(a, name)}: must be >= 1")
    if a.kmax > a.pages:
        raise UserError(f"--kmax {a.kmax}: must be <= --pages {a.pages} (a request recalls pages it holds)")
    if a.layers < 4:
        raise UserError(f"--layers {a.layers}: must be >= 4 (3 retriever layers plus one)")
    if not 0 <= a.turnover <= 1:
        raise UserError(f"--turnover {a.turnover}: must lie in [0, 1]")
    if not a.step_ms > 0 or a.cache_gb < 0 or min(a.lead_ms) < 0:
        raise UserError("--step-ms must be > 0, --cache-gb and --lead-ms >= 0")
    if a.dir and not os.path.isdir(a.dir):
        raise UserError(f"--dir {a.dir!r} is not an existing directory")


def layout(layers: int) -> OffloadLayout:
    return OffloadLayout(n_layers=layers, target_layers=(layers - 3, layers - 2, layers - 1))


def picks(rng: np.random.Generator, pages: int, kmax: int, turnover: float, prev: list[int]) -> list[int]:
    """One plan: round((1 - turnover) x kmax) of last cycle's picks kept, the rest new pages of the request."""
    keep = list(prev[: round((1.0 - turnover) * kmax)]) if prev else []
    rest = np.setdiff1d(np.arange(pages), keep)
    return keep + [int(x) for x in rng.choice(rest, kmax - len(keep), replace=False)]


def page_bytes_of(r: int, p: int, base: np.ndarray) -> np.ndarray:
    """Page p of request r: `base` with (r, p) in its first 16 bytes, so a misplaced read is caught."""
    out = base.copy()
    out[:16] = np.frombuffer(np.array([r, p], dtype=np.int64).tobytes(), dtype=np.uint8)
    return out


@dataclass
class Tally:
    """Counts of one run of cycles (see the module docstring for what each means)."""

    cycles: int = 0
    cycles_waited: int = 0
    recalls: int = 0
    recalls_waited: int = 0
    gets: int = 0
    hits: int = 0
    ahead: int = 0
    ahead_hits: int = 0
    copy_s: float = 0.0
    wait_s: float = 0.0

    def rates(self) -> dict[str, float]:
        return {
            "cache_hit_rate": self.hits / self.gets if self.gets else 0.0,
            "readahead_hit_rate": self.ahead_hits / self.ahead if self.ahead else 1.0,
            "recalls_waited_share": self.recalls_waited / self.recalls if self.recalls else 0.0,
            "cycles_waited_share": self.cycles_waited / self.cycles if self.cycles else 0.0,
        }


def run_cycles(cache: HostPageCache, a: argparse.Namespace, lead_s: float, staging: np.ndarray) -> Tally:
    """`a.cycles` cycles of `a.requests` recalls of `a.kmax` pages (seeded), counted into a Tally."""
    rng = np.random.default_rng(a.seed)
    prev: dict[int, list[int]] = {}
    t = Tally()
    for _ in range(a.cycles):
        plan = {r: picks(rng, a.pages, a.kmax, a.turnover, prev.get(r, [])) for r in range(a.requests)}
        cold = {r: {p for p in ps if not cache.resident(f"req{r}", p)} for r, ps in plan.items()}
        for r, ps in plan.items():
            cache.prefetch(f"req{r}", ps)
        if lead_s:
            time.sleep(lead_s)
        start, waited_cycle = time.perf_counter(), False
        for r, ps in plan.items():
            waited = False
            for i, p in enumerate(ps):
                here = cache.resident(f"req{r}", p)
                t.gets += 1
                t.hits += here
                if p in cold[r]:
                    t.ahead += 1
                    t.ahead_hits += here
                waited |= not here
                w = time.perf_counter()
                view = cache.get(f"req{r}", p)
                if not here:
                    t.wait_s += time.perf_counter() - w
                staging[i] = np.frombuffer(view, dtype=np.uint8)
                if tuple(staging[i, :16].view(np.int64)) != (r, p):
                    raise RuntimeError(f"bench tier-scale: page {p} of req{r} came back as another page")
            t.recalls += 1
            t.recalls_waited += waited
            waited_cycle |= waited
        t.copy_s += time.perf_counter() - start
        t.cycles += 1
        t.cycles_waited += waited_cycle
        prev = plan
    return t


def planned_bytes(a: argparse.Namespace) -> dict[str, int]:
    """Host memory (the cache, the staging rows, one base page) and disk (every page's slot) the run takes."""
    pb = disk_page_bytes(layout(a.layers))
    n = a.requests * a.pages
    cache = int(a.cache_gb * 1e9) if a.cache_gb else n * pb // 4
    return {
        "page": pb,
        "pages": n,
        "cache": cache,
        "host": cache + (a.kmax + 2) * pb,
        "disk": (n + 8) * (pb + SLOT_SLACK),
    }


def measure(a: argparse.Namespace) -> dict[str, Any]:
    need = planned_bytes(a)
    pb, n = need["page"], need["pages"]
    d, own = store_dir(a.dir, "fm-bench-tier-scale-")
    base = np.random.default_rng(a.seed).integers(0, 256, pb, dtype=np.uint8)
    staging = np.empty((a.kmax, pb), dtype=np.uint8)
    store = PageStore(d, need["disk"], pb, direct=not a.no_direct, what="--dir", size_what="--requests x --pages")
    cache: HostPageCache | None = None
    out: dict[str, Any] = {
        "page_bytes": pb,
        "requests": a.requests,
        "pages": a.pages,
        "kmax": a.kmax,
        "turnover": a.turnover,
        "cycles": a.cycles,
        "readers": a.readers,
        "tau": a.tau,
        "step_ms": a.step_ms,
        "o_direct": store.direct,
        "fallback": store.fallback_reason,
        "history_bytes": n * pb,
        "runs": [],
    }
    try:
        cache = HostPageCache(store, need["cache"], readers=a.readers)
        out["cache_bytes"] = cache.capacity_pages * pb
        t0 = time.perf_counter()
        for r in range(a.requests):
            for p in range(a.pages):
                cache.put(f"req{r}", p, memoryview(page_bytes_of(r, p, base)))
        check_written(cache, d, n)
        out["write_s"] = time.perf_counter() - t0
        for lead in a.lead_ms:
            cache.drop_clean()
            if not store.direct:
                os.fsync(store.fd)
                os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            before = cache.counters.as_dict()
            t = run_cycles(cache, a, lead / 1e3, staging)
            after = cache.counters.as_dict()
            delta = {
                k: after[k] - before[k]
                for k in ("disk_bytes_read", "readahead_late", "cache_hits", "cache_misses", "corrupt_pages")
            }
            window_s = a.tau * a.step_ms / 1e3
            out["runs"].append(
                {
                    "lead_ms": lead,
                    **asdict(t),
                    **t.rates(),
                    "counters": delta,
                    "copy_ms_per_cycle": 1e3 * t.copy_s / t.cycles,
                    "wait_ms_per_cycle": 1e3 * t.wait_s / t.cycles,
                    "window_share": t.copy_s / t.cycles / window_s,
                }
            )
    finally:
        close_store(cache, store, d, own)
    return out


def report(r: dict[str, Any]) -> None:
    mode = "O_DIRECT" if r["o_direct"] else f"buffered ({r['fallback'] or 'OS cache dropped before each run'})"
    print(
        f"disk tier at scale (measured on this machine): {r['requests']} requests x {r['pages']} pages of "
        f"{r['page_bytes']:,} B = {r['history_bytes'] / 1e9:.2f} GB on disk ({mode}); host page cache "
        f"{r['cache_bytes'] / 1e9:.3f} GB ({r['cache_bytes'] / r['history_bytes']:.0%} of the pages); "
        f"written behind in {r['write_s']:.1f} s"
    )
    print(
        f"{r['cycles']} cycles, {r['kmax']} pages recalled per request per cycle, turnover {r['turnover']:g}, "
        f"{r['readers']} read-ahead threads; window {r['tau']} x {r['step_ms']:g} ms (stated)"
    )
    print(
        f"{'lead ms':>8} {'cache hit':>10} {'read-ahead hit':>15} {'late':>6} {'recalls waited':>15} "
        f"{'cycles waited':>14} {'copy ms/cycle':>14} {'disk wait ms':>13} {'window':>7} {'disk GB':>8}"
    )
    for x in r["runs"]:
        print(
            f"{x['lead_ms']:>8g} {x['cache_hit_rate']:>10.2f} {x['readahead_hit_rate']:>15.2f} "
            f"{x['counters']['readahead_late']:>6} {x['recalls_waited_share']:>15.0%} "
            f"{x['cycles_waited_share']:>14.0%} "
            f"{x['copy_ms_per_cycle']:>14.0f} {x['wait_ms_per_cycle']:>13.0f} {x['window_share']:>7.0%} "
            f"{x['counters']['disk_bytes_read'] / 1e9:>8.2f}"
        )


def run(a: argparse.Namespace) -> int:
    _defaults(a)
    _check(a)
    from flashmemory.bench.tier import measure_checked

    return measure_checked(a, planned_bytes(a), "--cache-gb plus --kmax pages of --layers", measure, report)
