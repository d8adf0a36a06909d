"""Check (a): the offload engine on the device against the CPU engine, recall bandwidth and overlap.

1. Churn trace, bitwise. One random trace (admissions with the newest page opened, decode steps with padding
   rows and bursts of them that push pages out of the decode region, Level-1 recalls with a recency tail and
   budgets, a recall whose request decodes or finishes between plan and publish, finishes and row reuse) drives
   a device engine and a CPU engine with the same bytes (for at most `trace_budget_s` per layout). Every few
   operations, and at the end, their reserve contents (the sink block excepted: padding rows race to write it),
   lookup table, page tables, compact resident tables, target index pool and mirror must be equal byte for byte,
   and `check_invariants` must find nothing on either. Two layouts at DeepSeek-V4 entry sizes (584-B KV, 132-B
   index-K, 64-chunk pages; 21 c4 layers with targets 10, 12, 20, or 4 layers in the CPU quick run):
     copy    the engine allocates mirror pages and owns its target index pool; Path-I off (the served default);
     shrink  the caller owns the page ids (admission claims scattered "pool pages", later pages are added by
             id), the target index pool is a view of caller buffers, landing blocks are reserved, and Path-I is
             on (the non-target index-K in the mirror and the reserve, as with score-resident Level 2).
2. Recall bandwidth (CUDA): KMAX pages mirror -> reserve (`execute_recall`: host gather into pinned staging, then
   the copy on the side stream) against a raw pinned host->device copy of the same bytes.
3. Overlap (CUDA): a bf16 matmul loop on its own stream, timed alone and while recalls run (slowdown = ratio).
"""

from __future__ import annotations

import random
import time

import torch

from gpu_core.core import (
    CheckResult,
    EngineConfig,
    OffloadEngine,
    OffloadLayout,
    RecallRequest,
    Sizes,
    check_invariants,
    execute_recall,
    gen,
    plan_recall,
    publish_recall,
    random_engine_chunks,
    recall_sync,
    sync,
)

COMPARE_EVERY = 25


class _Twin:
    """The same operations on a device engine and a CPU engine. mode: "copy" or "shrink"."""

    def __init__(self, mode: str, sz: Sizes, device: torch.device, seed: int):
        self.mode, self.device = mode, device
        # DeepSeek-V4-Flash entry sizes; Path-I as served: off by default (copy), on with shrink + score-resident
        n_layers, targets = sz.trace_layers
        self.layout = OffloadLayout(n_layers=n_layers, target_layers=targets, index_offload=(mode == "shrink"))
        pc, rows = self.layout.page_chunks, sz.trace_rows
        self.max_pages = self.layout.pages_for(sz.trace_max_chunks)
        n_mirror = rows * self.max_pages + 4
        kw = dict(
            max_rows=rows,
            max_chunks=sz.trace_max_chunks,
            mirror_pages=n_mirror,
            recall_blocks=sz.trace_recall_blocks,
            decode_pages=2,
            max_resident_pages=sz.trace_kmax,
        )
        if mode == "shrink":
            kw["landing_blocks"] = 2
        cfg = EngineConfig(**kw)
        self.engines = []
        for dev in (device, torch.device("cpu")):
            bufs = None
            if mode == "shrink":
                bufs = [
                    torch.zeros(n_mirror, self.layout.index_page_bytes, dtype=torch.uint8, device=dev)
                    for _ in self.layout.target_layers
                ]
            self.engines.append(OffloadEngine(self.layout, cfg, dev, target_buffers=bufs))
        self.rng = random.Random(seed)
        self.g = gen(seed)
        self.pc, self.rows, self.cfg = pc, rows, cfg
        self.free_pool = list(range(n_mirror))  # shrink: page ids the caller owns
        self.rng.shuffle(self.free_pool)
        self.live: dict[int, list] = {}  # row -> [gen, n_chunks, pages owned (shrink)]
        self.counts = {k: 0 for k in ("admit", "decode", "burst", "recall", "recall_decode", "recall_finish", "finish")}

    def both(self, fn) -> list:
        return [fn(e) for e in self.engines]

    def admit(self) -> None:
        free = [r for r in range(self.rows) if r not in self.live]
        if not free:
            return
        row = self.rng.choice(free)
        n = self.rng.randint(1, self.cfg.max_chunks // 2)
        kv, ix = random_engine_chunks(self.layout, n, self.g)
        if self.mode == "copy":
            gens = self.both(lambda e: e.admit(row, kv, ix))
            owned: list[int] = []
        else:
            owned = [self.free_pool.pop() for _ in range(self.layout.pages_for(n))]
            j = torch.arange(n)
            m = torch.tensor(owned, dtype=torch.int64)[j // self.pc] * self.pc + j % self.pc
            for e in self.engines:  # the transfer lands the bytes in the mirror and the index-K pool first
                e.mirror.write(m, kv, ix)
                e.target.write(m, ix)
            gens = self.both(lambda e: e.admit(row, None, None, mpages=owned, n_chunks=n))
        self.both(lambda e: e.open_tail_page(row))
        self.live[row] = [gens[0], n, owned]
        self.counts["admit"] += 1

    def decode(self) -> None:
        rows = [r for r, st in self.live.items() if st[1] < self.cfg.max_chunks]
        rows = self.rng.sample(rows, self.rng.randint(0, len(rows)))
        batch = rows + [-1] * self.rng.randint(0, 2)
        self.rng.shuffle(batch)
        if not batch:
            return
        if self.mode == "shrink":
            for r in rows:
                st = self.live[r]
                if st[1] % self.pc == 0:  # crossing into a new page: the caller hands the engine its id
                    p = self.free_pool.pop()
                    st[2].append(p)
                    self.both(lambda e, r=r, p=p: e.add_pages(r, [p]))
        kv, ix = random_engine_chunks(self.layout, len(batch), self.g)
        cells = self.both(lambda e: e.decode_append(batch, kv, ix))
        if not torch.equal(cells[0].cpu(), cells[1].cpu()):
            raise AssertionError(f"{self.mode}: decode cells differ: {cells[0].tolist()} vs {cells[1].tolist()}")
        for r in rows:
            self.live[r][1] += 1
        self.counts["decode"] += 1

    def requests(self) -> list[RecallRequest]:
        reqs = []
        for r in self.rng.sample(sorted(self.live), self.rng.randint(1, len(self.live))):
            g_, n, _ = self.live[r]
            n_pages = self.layout.pages_for(n)
            pages = self.rng.sample(range(n_pages), min(n_pages, self.rng.randint(1, self.cfg.max_resident_pages + 2)))
            prio = tuple(float("inf") if p >= n_pages - 1 else self.rng.random() for p in pages)
            budget = self.rng.choice([None, None, max(1, self.cfg.max_resident_pages // 2)])
            reqs.append(RecallRequest(r, g_, tuple(pages), prio, budget=budget))
        return reqs

    def recall(self) -> None:
        if not self.live:
            return
        reqs = self.requests()
        kind = self.rng.choice(["recall", "recall", "recall_decode", "recall_finish"])
        plans = self.both(lambda e: plan_recall(e, reqs))
        if kind == "recall_decode":  # decode maps pages between plan and publish: those are discarded
            self.decode()
        elif kind == "recall_finish":  # the request finishes (and its row may be reused) while in flight
            self.finish(reqs[0].row)
            if self.rng.random() < 0.5:
                self.admit()
        for e, p in zip(self.engines, plans):
            execute_recall(e, p)
            publish_recall(e, p)
        self.counts[kind] += 1

    def finish(self, row: int | None = None) -> None:
        if not self.live:
            return
        row = self.rng.choice(sorted(self.live)) if row is None else row
        self.both(lambda e: e.finish(row))
        self.free_pool += self.live.pop(row)[2]
        self.counts["finish"] += 1

    def burst(self) -> None:
        """Decode long enough for pages to leave the decode region (promoted to a recall block, or spilled)."""
        for _ in range(self.rng.randint(32, 80)):
            self.decode()
        self.counts["burst"] += 1

    def step(self) -> None:
        op = self.rng.choices(["admit", "decode", "burst", "recall", "finish"], weights=[2, 6, 1, 4, 1])[0]
        if op == "admit" or not self.live:
            self.admit()
        else:
            getattr(self, op)()

    def compare(self) -> list[str]:
        """Byte-for-byte differences between the two engines' device state (empty = equal)."""
        d, c = self.engines
        sink = d.reserve.sink_block
        keep = torch.ones(d.reserve.n_blocks, dtype=torch.bool)
        keep[sink] = False
        pairs = {
            "reserve.kv": (d.reserve.kv[:, keep.to(d.device)], c.reserve.kv[:, keep]),
            "reserve.index": (d.reserve.index[:, keep.to(d.device)], c.reserve.index[:, keep]),
            "lut.table": (d.lut.table, c.lut.table),
            "lut.row_pages": (d.lut.row_pages, c.lut.row_pages),
            "res_pages": (d.res_pages, c.res_pages),
            "res_blocks": (d.res_blocks, c.res_blocks),
            "res_mpages": (d.res_mpages, c.res_mpages),
            "res_count": (d.res_count, c.res_count),
            "mirror.kv": (d.mirror.kv, c.mirror.kv),
            "mirror.index": (d.mirror.index, c.mirror.index),
        }
        tp_d, tp_c = d.target.pages, c.target.pages
        for i in range(len(self.layout.target_layers)):
            pairs[f"target[{i}]"] = (tp_d[i], tp_c[i])
        bad = [f"{self.mode}: {k} differs" for k, (x, y) in pairs.items() if not torch.equal(x.cpu(), y.cpu())]
        for tag, e in (("device", d), ("cpu", c)):
            bad += [f"{self.mode} {tag} engine: {v}" for v in check_invariants(e)[:3]]
        return bad


def _trace(res: CheckResult, sz: Sizes, device: torch.device, seed: int) -> None:
    for i, mode in enumerate(("copy", "shrink")):
        t0 = time.perf_counter()
        tw = _Twin(mode, sz, device, seed + i)
        if device.type == "cuda":
            res.expect(tw.engines[0].mirror.kv.is_pinned(), f"{mode}: the host mirror is not pinned on a CUDA engine")
        bad: list[str] = []
        done = 0
        while done < sz.trace_ops:
            tw.step()
            done += 1
            late = time.perf_counter() - t0 > sz.trace_budget_s  # the run must fit its 8 minutes: stop early
            if done % COMPARE_EVERY == 0 or done == sz.trace_ops or late:
                bad = [f"after op {done}: {b}" for b in tw.compare()]
                if bad or late:
                    break
        for b in bad:
            res.fail(b)
        tot = tw.engines[0].metrics()["total"]  # the engine paths the trace reached (device engine)
        seen = {
            k: tot.get(k, 0)
            for k in (
                "recall_pages",
                "evictions",
                "budget_hits",
                "cancelled_pages",
                "decode_promotions",
                "decode_spills",
                "decode_page_opens",
            )
        }
        res.figures[f"trace_{mode}"] = dict(
            ops=done,
            ops_planned=sz.trace_ops,
            **tw.counts,
            **seen,
            equal=not bad,
            seconds=round(time.perf_counter() - t0, 2),
        )


def _bandwidth_engine(sz: Sizes, device: torch.device) -> tuple[OffloadEngine, int, int]:
    """One request of 2*KMAX + 1 pages whose bytes sit in the mirror (claimed, as PD lands them); returns
    (engine, row generation, KMAX). Recalls alternate between the two halves, KMAX pages each."""
    lay, k = OffloadLayout(), sz.recall_kmax
    n_pages = 2 * k + 1
    cfg = EngineConfig(
        max_rows=1,
        max_chunks=n_pages * lay.page_chunks,
        mirror_pages=n_pages,
        recall_blocks=k,
        decode_pages=1,
        max_resident_pages=k,
    )
    eng = OffloadEngine(lay, cfg, device)
    g = torch.Generator().manual_seed(0)
    for t in (eng.mirror.kv, eng.mirror.index):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    g_ = eng.admit(0, None, None, mpages=list(range(n_pages)), n_chunks=n_pages * lay.page_chunks)
    return eng, g_, k


def _half(g_: int, k: int, i: int) -> list[RecallRequest]:
    pages = tuple(range((i % 2) * k, (i % 2 + 1) * k))
    return [RecallRequest(0, g_, pages, tuple(1.0 for _ in pages))]


def _bandwidth(res: CheckResult, sz: Sizes, device: torch.device) -> None:
    eng, g_, k = _bandwidth_engine(sz, device)
    recall_sync(eng, _half(g_, k, 1))  # warm-up: staging buffers, kernels
    t_exec, t_gather, nbytes = [], [], 0
    for i in range(2 * max(2, sz.repeats)):
        plan = plan_recall(eng, _half(g_, k, i))
        sync(device)
        t0 = time.perf_counter()
        execute_recall(eng, plan)
        sync(device)
        t_exec.append(time.perf_counter() - t0)
        publish_recall(eng, plan)
        nbytes = plan.nbytes
        src = torch.tensor([e[3] for e in plan.entries], dtype=torch.int64)
        stage = eng.staging["kv"][: eng.mirror.kv.shape[0] * len(src) * eng.mirror.kv.shape[2]]
        t0 = time.perf_counter()  # the host half alone: the gather of the c4 KV into pinned staging
        torch.index_select(eng.mirror.kv, 1, src, out=stage.view(eng.mirror.kv.shape[0], len(src), -1))
        t_gather.append(time.perf_counter() - t0)
    res.expect(
        nbytes
        == k
        * (eng.reserve.kv.shape[0] * eng.reserve.kv.shape[2] + eng.reserve.index.shape[0] * eng.reserve.index.shape[2]),
        f"recall moved {nbytes} B for {k} pages",
    )
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t_raw = []
    for _ in range(2 * max(2, sz.repeats) + 1):
        sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        t_raw.append(time.perf_counter() - t0)
    t_raw = t_raw[1:]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    bw, bw_raw = nbytes / med(t_exec) / 1e9, nbytes / med(t_raw) / 1e9
    res.figures["recall"] = dict(
        pages=k,
        bytes=nbytes,
        recall_s=med(t_exec),
        recall_GBps=bw,
        kv_host_gather_s=med(t_gather),
        raw_pinned_s=med(t_raw),
        raw_pinned_GBps=bw_raw,
        recall_vs_raw=bw / bw_raw,
        goal=">= 0.8",
    )
    _overlap(res, eng, g_, k, device)


def _overlap(res: CheckResult, eng: OffloadEngine, g_: int, k: int, device: torch.device) -> None:
    """bf16 matmuls on their own stream, timed with events alone and while recalls run back to back."""
    s = torch.cuda.Stream(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    n_mm = 150

    def run_compute() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            e0.record(s)
            for _ in range(n_mm):
                torch.mm(a, a)
            e1.record(s)
        return e0, e1

    e0, e1 = run_compute()
    e1.synchronize()
    e0, e1 = run_compute()
    e1.synchronize()
    alone = e0.elapsed_time(e1) / 1e3
    e0, e1 = run_compute()
    n_rec, moved, t0 = 0, 0, time.perf_counter()
    while not e1.query() or n_rec == 0:
        moved += recall_sync(eng, _half(g_, k, n_rec)).nbytes
        n_rec += 1
    t_rec = time.perf_counter() - t0
    e1.synchronize()
    with_recall = e0.elapsed_time(e1) / 1e3
    res.figures["overlap"] = dict(
        compute=f"{n_mm} x bf16 mm 8192^3 on its own stream",
        compute_alone_s=alone,
        compute_with_recall_s=with_recall,
        slowdown=with_recall / alone,
        recalls_during=n_rec,
        recall_GBps_during=moved / t_rec / 1e9,
    )
    res.expect(not check_invariants(eng), "bandwidth engine: invariants violated after the recalls")


def run(sz: Sizes, device: torch.device, seed: int) -> CheckResult:
    res = CheckResult("a", "offload engine: device vs CPU engine, recall bandwidth, overlap")
    _trace(res, sz, device, seed)
    if device.type == "cuda":
        _bandwidth(res, sz, device)
    else:
        res.skipped.append("recall bandwidth and overlap: need CUDA (pinned copies, a side stream)")
    tr = [res.figures.get(f"trace_{m}", {}) for m in ("copy", "shrink")]
    ops = "/".join(str(t.get("ops", 0)) for t in tr)
    parts = [f"copy/shrink traces ({ops} ops) " + ("bitwise equal" if all(t.get("equal") for t in tr) else "DIFFER")]
    if "recall" in res.figures:
        r = res.figures["recall"]
        parts.append(
            f"recall {r['recall_GBps']:.1f} GB/s = {r['recall_vs_raw']:.2f}x raw pinned "
            f"{r['raw_pinned_GBps']:.1f} GB/s (goal >= 0.8)"
        )
    if "overlap" in res.figures:
        parts.append(f"compute slowdown {res.figures['overlap']['slowdown']:.3f}x while recalling")
    res.summary = "; ".join(parts)
    return res
