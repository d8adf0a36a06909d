"""`flashmemory bench recall`: page recall and Level 2, each as a ratio against a baseline timed in the same run.

1. page recall (one batched gather per layer group, mirror -> reserve) vs a raw contiguous copy of the same
   bytes, for KMAX pages over all c4 layers (+ Path-I index pages);
2. batched gather vs one copy per (layer, page);
3. Level 2 at N chunks and 10% residency: mask mode and score-resident mode vs unmasked native top-k;
4. Level-1 host planning at serving scale (`plan_recall` + `publish_recall`, bytes copy excluded): per-cycle
   cost and the longest engine-lock hold (wall, and the holder's CPU time: the wall time of a preempted holder
   on a shared machine is not the lock's cost), as a fraction of the cycle window (tau x decode step) and of
   one step (plan and publish take the lock in slices: `Recaller.slice_pages`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from flashmemory.bench.guard import require_memory
from flashmemory.errors import UserError
from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, RecallRequest, gather_copy
from flashmemory.offload.gather import page_by_page_copy
from flashmemory.offload.recall import plan_recall, publish_recall, recall_now
from flashmemory.retriever.fp8 import quantize_chunks


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer repeats and a smaller Level-2 batch (< 60 s, < 3 GB)")
    p.add_argument("--kmax", type=int, nargs="+", default=[96, 192, 384], help="pages recalled per measurement")
    p.add_argument("--layers", type=int, default=21, help="c4 layers")
    p.add_argument("--chunks", type=int, default=65536, help="history length for Level 2, in chunks")
    p.add_argument("--residency", type=float, default=0.10, help="resident fraction of pages for Level 2")
    p.add_argument("--batch", type=int, default=0, help="Level-2 batch (0 = 2 with --quick, else 8)")
    p.add_argument("--heads", type=int, default=64, help="indexer heads")
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--reps", type=int, default=0, help="repeats per timing (0 = 2 with --quick, else 5)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plan-rows", type=int, default=128, help="planning: admitted requests (EngineConfig.max_rows)")
    p.add_argument("--plan-blocks", type=int, default=8192, help="planning: recall blocks per layer")
    p.add_argument("--plan-kmax", type=int, default=96, help="planning: per-request page cap (KMAX)")
    p.add_argument(
        "--plan-chunks",
        type=int,
        default=0,
        help="planning: history per request, in chunks (0 = 16384 with --quick, else 65536)",
    )
    p.add_argument("--tau", type=int, default=64, help="planning budget: decode steps per Level-1 cycle")
    p.add_argument("--step-ms", type=float, default=30.0, help="planning budget: one decode step, in ms")


def _time(fn: Callable[[], object], reps: int, dev: torch.device) -> float:
    """Best of `reps` wall times after one warm-up, in seconds."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _recall_rows(args, dev: torch.device, reps: int, bar) -> list[tuple[str, str, str]]:
    lay = OffloadLayout(n_layers=args.layers, target_layers=(min(10, args.layers - 1),))
    kmax = max(args.kmax)
    eng = OffloadEngine(
        lay,
        EngineConfig(
            max_rows=1,
            max_chunks=2 * kmax * 64,
            mirror_pages=2 * kmax,
            recall_blocks=kmax,
            decode_pages=1,
            max_resident_pages=kmax,
        ),
        dev,
    )
    m, r = eng.mirror, eng.reserve
    m.kv.random_(0, 256)
    m.index.random_(0, 256)
    rows = []
    stage: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    for k in sorted(args.kmax):
        src = torch.randperm(2 * kmax, generator=g)[:k]
        dst = torch.randperm(kmax, generator=g)[:k]
        kv_b, ix_b = k * m.kv.shape[0] * m.kv.shape[2], k * m.index.shape[0] * m.index.shape[2]

        def batched(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:  # staging reused, as the engine does
            stage["kv"] = gather_copy(m.kv, r.kv, src, dst, stage.get("kv")).view(-1)
            if m.index.shape[0]:
                stage["ix"] = gather_copy(m.index, r.index, src, dst, stage.get("ix")).view(-1)

        def raw(kv_b: int = kv_b, ix_b: int = ix_b) -> None:
            r.kv.view(-1)[:kv_b].copy_(m.kv.view(-1)[:kv_b], non_blocking=True)
            if ix_b:
                r.index.view(-1)[:ix_b].copy_(m.index.view(-1)[:ix_b], non_blocking=True)

        t_b, t_r = _time(batched, reps, dev), _time(raw, reps, dev)
        nbytes = kv_b + ix_b
        rows.append(
            (
                f"recall K={k} x {args.layers} layers ({nbytes / 1e6:.0f} MB)",
                f"{nbytes / t_b / 1e9:.2f} GB/s vs raw {nbytes / t_r / 1e9:.2f} GB/s",
                f"{t_r / t_b:.2f}x of raw copy",
            )
        )
        bar.update(1)
    k = min(args.kmax)
    src, dst = torch.randperm(2 * kmax, generator=g)[:k], torch.randperm(kmax, generator=g)[:k]
    t_loop = _time(lambda: page_by_page_copy(m.kv, r.kv, src.tolist(), dst.tolist()), max(1, reps // 2), dev)
    t_b = _time(lambda: gather_copy(m.kv, r.kv, src, dst, stage.get("kv")), reps, dev)
    rows.append(
        (
            f"batched gather vs page-by-page, K={k} x {args.layers} layers (c4 KV)",
            f"{t_b * 1e3:.1f} ms vs {t_loop * 1e3:.1f} ms",
            f"speedup {t_loop / t_b:.2f}x",
        )
    )
    bar.update(1)
    del eng
    return rows


def _level2_rows(args, dev: torch.device, reps: int, bar) -> list[tuple[str, str, str]]:
    from flashmemory.residency.level2 import Level2, paged_index_logits

    b = args.batch or (2 if args.quick else 8)
    n, pc, d = args.chunks, 64, 128
    n_pages = -(-n // pc)
    kres = max(1, round(args.residency * n_pages))
    lay = OffloadLayout(n_layers=2, target_layers=(0,), kv_widths=(8,), kv_align=1, index_head_dim=d)
    eng = OffloadEngine(
        lay,
        EngineConfig(max_rows=b, max_chunks=n, recall_blocks=b * kres, decode_pages=1, max_resident_pages=kres),
        dev,
    )
    g = torch.Generator().manual_seed(1)
    for row in range(b):
        ix = quantize_chunks(torch.randn(n, d, generator=g)).unsqueeze(0).expand(2, -1, -1).contiguous()
        gen = eng.admit(row, torch.zeros(2, n, 8, dtype=torch.uint8), ix)
        pages = torch.randperm(n_pages, generator=g)[:kres].tolist()
        recall_now(eng, [RecallRequest(row, gen, tuple(pages), tuple(1.0 for _ in pages))])
    bar.update(1)
    l2 = Level2(eng, max_batch=b, topk=args.topk)
    rows_t = torch.arange(b, device=dev)
    q = torch.randn(b, args.heads, d, generator=g).to(dev)
    w = torch.rand(b, args.heads, generator=g).to(dev)
    pages, table = eng.target.pages[0], eng.lut.row_pages[:b]

    def native():
        return paged_index_logits(q, w, pages, table, pc)[:, :n].topk(args.topk, dim=1)

    def mask():
        return l2.mask_topk(paged_index_logits(q, w, pages, table, pc)[:, :n], rows_t)

    def score_res():
        return l2.score_resident_topk(q, w, rows_t, 0)

    t_n = _time(native, reps, dev)
    t_m = _time(mask, reps, dev)
    t_s = _time(score_res, reps, dev)
    bar.update(1)
    assert (l2.score_resident_topk(q, w, rows_t, 0).cells >= 0).all()
    tag = f"N={n}, {args.residency:.0%} resident, B={b}, top-{args.topk}"
    return [
        (
            f"Level-2 mask mode ({tag})",
            f"{t_m * 1e3:.1f} ms vs native {t_n * 1e3:.1f} ms",
            f"{t_m / t_n:.2f}x native time",
        ),
        (
            f"Level-2 score-resident ({tag})",
            f"{t_s * 1e3:.1f} ms vs native {t_n * 1e3:.1f} ms",
            f"speedup {t_n / t_s:.2f}x vs native",
        ),
    ]


class _HoldTimer:
    """Stands in for `engine.lock` (an RLock) and records each outermost hold: wall seconds in `holds`, and this
    thread's CPU seconds in `cpu` (the work done under the lock, what the hold costs on an idle core: on a shared
    machine the wall time also counts the time the holder was preempted)."""

    def __init__(self, lock) -> None:
        self._lock, self._depth, self._t0, self._c0 = lock, 0, 0.0, 0.0
        self.holds: list[float] = []
        self.cpu: list[float] = []

    def acquire(self, *a, **kw) -> bool:
        ok = self._lock.acquire(*a, **kw)
        if ok:
            self._depth += 1
            if self._depth == 1:
                self._t0, self._c0 = time.perf_counter(), time.thread_time()
        return ok

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.holds.append(time.perf_counter() - self._t0)
            self.cpu.append(time.thread_time() - self._c0)
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def _plan_scenarios(args, dev: torch.device, reps: int, bar) -> list[tuple[str, ...]]:
    """Level-1 host planning at serving scale. One engine with `--plan-rows` admitted requests (tiny byte widths,
    real page geometry: 21 layers, 64-chunk pages), driven through four cycles in sequence:

    (a) cold: nothing resident, every row selects KMAX new pages (the reserve fills, the rest is dropped);
    (-) rebalance to blocks/rows pages per row (not reported): the reserve is exactly full;
    (b) steady: every row swaps 10% of its pages (evictions through the shared LRU), best of `reps`;
    (c) exhausted: every row keeps half its pages and adds as many new ones up to KMAX: new pages demanded are
        2x the blocks that can be reclaimed; the rest are dropped after a failed victim search each.

    Bytes are not copied (`execute_recall` is skipped): only host bookkeeping is timed. Returns table rows.
    """
    n_rows, kmax, n_blocks = args.plan_rows, args.plan_kmax, args.plan_blocks
    n_chunks = args.plan_chunks or (16384 if args.quick else 65536)
    lay = OffloadLayout(
        n_layers=21, page_chunks=64, kv_widths=(1,), kv_align=1, index_head_dim=1, target_layers=(10, 12, 20)
    )
    eng = OffloadEngine(
        lay,
        EngineConfig(
            max_rows=n_rows, max_chunks=n_chunks, recall_blocks=n_blocks, max_resident_pages=kmax, pin_memory=False
        ),
        dev,
    )
    kv = torch.zeros(lay.n_layers, n_chunks, lay.kv.chunk_bytes, dtype=torch.uint8)
    ix = torch.zeros(lay.n_layers, n_chunks, lay.index.chunk_bytes, dtype=torch.uint8)
    gens = [eng.admit(r, kv, ix) for r in range(n_rows)]
    del kv, ix
    timer = _HoldTimer(eng.lock)
    eng.lock = timer
    usable = lay.pages_for(n_chunks) - 1  # the last (partial) page is never selected: it is not evictable
    per_row = n_blocks // n_rows  # pages per row when the reserve is exactly shared
    keep_n = min(per_row // 2, kmax)
    if usable < per_row + kmax - keep_n:
        raise ValueError(f"--plan-chunks {n_chunks} too short: need > {64 * (per_row + kmax - keep_n + 1)} chunks")
    g = torch.Generator().manual_seed(2)
    sel: list[list[int]] = [[] for _ in range(n_rows)]

    def fresh(row: int, k: int) -> list[int]:
        out, taken = [], set(sel[row])
        for p in torch.randperm(usable, generator=g).tolist():
            if len(out) == k:
                break
            if p not in taken:
                out.append(p)
        return out

    def cycle(pick: Callable[[int], list[int]]) -> tuple[float, float, float, float, dict[str, int]]:
        reqs = []
        for r in range(n_rows):
            sel[r] = pick(r)
            reqs.append(RecallRequest(r, gens[r], tuple(sel[r]), tuple(torch.rand(len(sel[r]), generator=g).tolist())))
        before = {k: sum(c[k] for c in eng.stats.per_req.values()) for k in ("evictions", "budget_hits")}
        timer.holds.clear()
        timer.cpu.clear()
        t0 = time.perf_counter()
        plan = plan_recall(eng, reqs)
        t1 = time.perf_counter()
        publish_recall(eng, plan)
        t2 = time.perf_counter()
        cnt = {k: sum(c[k] for c in eng.stats.per_req.values()) - v for k, v in before.items()}
        cnt["pages"] = len(plan.entries)
        return t1 - t0, t2 - t1, max(timer.holds), max(timer.cpu), cnt

    budget = args.tau * args.step_ms / 1e3
    out: list[tuple[str, ...]] = []

    def report(name: str, res: tuple[float, float, float, float, dict[str, int]]) -> None:
        t_plan, t_pub, hold, cpu, c = res
        step = args.step_ms / 1e3
        out.append(
            (
                name,
                f"{c['pages']} / {c['budget_hits']} / {c['evictions']}",
                f"{t_plan * 1e3:.1f}",
                f"{t_pub * 1e3:.1f}",
                f"{hold * 1e3:.1f} ({cpu * 1e3:.1f})",
                f"{(t_plan + t_pub) / budget:.3f}",
                f"{hold / step:.2f} ({cpu / step:.2f})",
            )
        )

    report(f"(a) cold: {n_rows} rows x {kmax} new pages", cycle(lambda r: fresh(r, kmax)))
    bar.update(1)
    cycle(lambda r: (sel[r] + fresh(r, per_row))[:per_row])  # rebalance: every row holds per_row pages
    swap = max(1, per_row // 10)
    runs = [cycle(lambda r: sel[r][swap:] + fresh(r, swap)) for _ in range(reps)]
    report(f"(b) steady: {per_row} pages/row resident, {swap} swapped per row", min(runs, key=lambda x: x[0] + x[1]))
    bar.update(1)
    report(
        f"(c) exhausted: keep {keep_n}, add {kmax - keep_n} per row (2x reclaimable)",
        cycle(lambda r: sel[r][:keep_n] + fresh(r, kmax - keep_n)),
    )
    bar.update(1)
    eng.lock = timer._lock
    return out


def _print_table(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    w = [max(len(x) for x in col) for col in zip(head, *rows)]
    print(title)
    for r in (head, *rows):
        print("  ".join(f"{x:<{n}}" for x, n in zip(r, w)).rstrip())


def _check(args: argparse.Namespace) -> None:
    """Refuse, before any work: a resident fraction outside (0, 1]; page recalls whose buffers would not fit in
    host memory (the mirror holds 2 x KMAX pages, the reserve and the staging copy KMAX each, of all --layers);
    a planning history too short for the exhausted cycle of `_plan_scenarios`."""
    if not 0 < args.residency <= 1:
        raise UserError(f"--residency {args.residency}: must lie in (0, 1] (a fraction of the pages)")
    lay = OffloadLayout(n_layers=args.layers, target_layers=(min(10, args.layers - 1),))
    page = lay.page_chunks * (lay.kv.chunk_bytes + lay.index.chunk_bytes) * lay.n_layers
    require_memory(4 * max(args.kmax) * page, f"--kmax {max(args.kmax)} x --layers {args.layers}")
    n_rows, kmax, n_blocks = args.plan_rows, args.plan_kmax, args.plan_blocks
    n_chunks = args.plan_chunks or (16384 if args.quick else 65536)
    usable = -(-n_chunks // 64) - 1  # 64-chunk pages; the last (partial) one is never selected
    per_row = n_blocks // n_rows
    keep_n = min(per_row // 2, kmax)
    if usable < per_row + kmax - keep_n:
        raise UserError(
            f"--plan-chunks {n_chunks}: too short for --plan-rows {n_rows}, --plan-blocks {n_blocks} and "
            f"--plan-kmax {kmax}: need > {64 * (per_row + kmax - keep_n + 1)} chunks"
        )


def run(args: argparse.Namespace) -> int:
    _check(args)
    dev = torch.device(args.device)
    reps = args.reps or (2 if args.quick else 5)
    with tqdm(total=len(args.kmax) + 6, desc="bench recall", leave=False) as bar:
        rows = _recall_rows(args, dev, reps, bar)
        rows += _level2_rows(args, dev, reps, bar)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # host planning runs tiny ops on one worker thread; fan-out only adds contention
        try:
            plan_rows = _plan_scenarios(args, dev, reps, bar)
        finally:
            torch.set_num_threads(threads)
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"bench recall on {dev} (best of {reps}; ratios against baselines timed in this run)")
    print(f"{'measurement':<{w0}}  {'time / throughput':<{w1}}  ratio")
    for a, b_, c in rows:
        print(f"{a:<{w0}}  {b_:<{w1}}  {c}")
    print()
    _print_table(
        f"Level-1 host planning, one cycle over {args.plan_rows} rows, {args.plan_blocks} recall blocks, "
        f"KMAX {args.plan_kmax}; bytes copy excluded; budget = tau {args.tau} x {args.step_ms:g} ms step "
        f"= {args.tau * args.step_ms:g} ms; lock holds as wall (holder's CPU) time",
        (
            "cycle",
            "planned / dropped / evicted",
            "plan ms",
            "publish ms",
            "max lock hold ms",
            "(plan+publish) / budget",
            "lock hold / step",
        ),
        plan_rows,
    )
    return 0
