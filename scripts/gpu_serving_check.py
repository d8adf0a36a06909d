#!/usr/bin/env python3
"""The serving adapter's decode hooks on one GPU, without sglang: one prepared run for a lent GPU (< 5 minutes).

    PYTHONPATH=. python scripts/gpu_serving_check.py                  # CUDA -> docs/gpu/serving/results.*
    PYTHONPATH=. python scripts/gpu_serving_check.py --device cpu     # tiny sizes, the same sequence (tests)

The plugin's own objects run as sglang drives them: `runtime.Runtime` attaches the copy-mode adapter
(`adapter_factory.build`, the one the plugin builds) to a stand-in pool (`StandInPool`: the attributes the adapter
reads of sglang's DeepSeekV4TokenToKVPool, with its page layout), with a tiny retriever so Level 1 scores on
the device. Each decode step is the hook sequence: `Runtime.before_forward` (sync the batch, publish the
Level-2 buffers), then per c4 layer the side-band copy (target layers), `resident_view` and a top-k stand-in
over it, `cells_of`, the step's store into the pool and `refresh_from_pool`, then `Runtime.after_decode_forward`
(settle, the Level-1 cycle on its worker thread). Requests join and leave while it runs.
Checks, one verdict line each:
  steps  ~50 decode steps under torch.cuda.set_sync_debug_mode("warn"): syncs on the decode thread per step,
         by kind of step (quiet, admitting, chunk-closing); PASS when quiet steps have none; every resident pick
         reads the pool's bytes in the reserve (checked after the timed part)
  graph  resident_view + cells_of captured in a CUDA graph, replayed while Level 1 changes the resident set and
         compared with eager every step (CPU: skipped)
It writes results.json and results.md (--out; default docs/gpu/serving on CUDA, nothing on CPU) and exits 1 if a
check failed. It needs torch and this repository only: no sglang import (a stand-in pool is the seam).
"""

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]  # the package, and scripts/gpu_serving

from gpu_serving.stand_in import Decode, Sizes, SyncCounter  # noqa: E402

PROG = "gpu_serving_check"


@dataclass
class Check:
    name: str
    title: str
    ok: bool = True
    summary: str = ""
    failures: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    def fail(self, msg: str) -> None:
        self.ok = False
        self.failures.append(msg)


def schedule(sz: Sizes) -> dict[int, str]:
    """Step -> event: a request joins ("join") or the oldest leaves ("leave"), a few times during the run."""
    ev = {}
    for i, s in enumerate(range(8, sz.steps, 8)):
        ev[s] = "join" if i % 2 == 0 else "leave"
    return ev


def check_steps(sz: Sizes, device: torch.device, seed: int) -> Check:
    res = Check("steps", f"{sz.steps} decode steps of the hook sequence, syncs on the decode thread counted")
    dec = Decode(sz, device, seed)
    try:
        for _ in range(sz.batch - 1):
            dec.admit()
        for _ in range(3):  # warm-up: first forwards of a batch size check the side band (a documented sync)
            dec.step()
        cuda = device.type == "cuda"
        per_kind: dict[str, list[int]] = {"quiet": [], "closing": [], "join/leave": []}
        events = schedule(sz)
        t0 = time.perf_counter()
        with SyncCounter() as sc:
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                for s in range(sz.steps):
                    kind = events.get(s)
                    if kind == "join":
                        dec.admit()
                    elif kind == "leave":
                        dec.finish(next(iter(dec.reqs)))
                    closing = any((q["seq"] + 1) % 4 == 0 for q in dec.reqs.values())
                    before = sc.decode
                    dec.step(sc)
                    per_kind["join/leave" if kind else "closing" if closing else "quiet"].append(sc.decode - before)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        dec.adapter.l1.wait()
        bad = checked = 0
        for _ in range(4):  # correctness, outside the counted part: resident picks read the pool's bytes
            dec.step()
            dec.adapter.open_forward(True)  # hold Level-1 publishes while the picks are read back
            try:
                table, lens = dec.c4_tables(list(dec.reqs))
                picks = dec.picks(table, lens)
                wrong, n = dec.bytes_match(picks, dec.adapter.cells_of(picks))
                bad, checked = bad + wrong, checked + n
            finally:
                dec.adapter.close_forward()
        syncs = {k: sum(v) for k, v in per_kind.items()}
        res.figures = dict(
            steps=sz.steps,
            batch=sz.batch,
            c4_layers=sz.n_c4,
            host_ms_per_step=round(1000 * wall / sz.steps, 3),
            steps_by_kind={k: len(v) for k, v in per_kind.items()},
            decode_thread_syncs_by_kind=syncs,
            syncs_by_thread=dict(sc.by_thread),
            decode_sync_sites=dict(sorted(sc.sites.items(), key=lambda kv: -kv[1])[:12]),
            level1_cycles=int(dec.adapter.engine.totals()["cycles"]),
            resident_picks_checked=checked,
            resident_picks_with_wrong_bytes=bad,
        )
        if not checked:
            res.fail("no resident pick to check: the reserve held none of the picked chunks")
        if bad:
            res.fail(f"{bad} resident picks read reserve bytes that differ from the pool's")
        if res.figures["level1_cycles"] == 0:
            res.fail("Level 1 never completed a cycle")
        if cuda and syncs["quiet"]:
            res.fail(f"{syncs['quiet']} syncs on the decode thread in {len(per_kind['quiet'])} quiet steps")
        counted = ", ".join(f"{syncs[k]} in {len(v)} {k} steps" for k, v in per_kind.items())
        res.summary = (
            (f"decode-thread syncs: {counted}; " if cuda else "syncs not counted on CPU; ")
            + f"{res.figures['host_ms_per_step']} ms host per step; {res.figures['level1_cycles']} Level-1 cycles; "
            f"{bad} of {checked} resident picks with wrong bytes"
        )
        return res
    finally:
        dec.close()


def check_graph(sz: Sizes, device: torch.device, seed: int) -> Check:
    res = Check("graph", "resident_view + cells_of captured in a CUDA graph, replay vs eager")
    if device.type != "cuda":
        res.summary = "skipped: CUDA graphs need CUDA"
        return res
    dec = Decode(sz, device, seed + 7)
    try:
        for _ in range(sz.batch):
            dec.admit()
        for _ in range(3):
            dec.step()
        rids = list(dec.reqs)
        table, lens = dec.c4_tables(rids)
        static_table, static_lens = table.clone(), lens.clone()

        def fn() -> tuple[torch.Tensor, torch.Tensor]:
            picks = dec.picks(static_table, static_lens)
            return picks, dec.adapter.cells_of(picks)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        n, mism, changed = 20, 0, 0
        last = None
        for _ in range(n):
            dec.step()
            dec.adapter.open_forward(True)  # as a forward: Level-1 publishes wait until it is enqueued
            try:
                t, ln = dec.c4_tables(rids)
                static_table.copy_(t)
                static_lens.copy_(ln)
                graph.replay()
                eager = fn()
                torch.cuda.synchronize()
                mism += int(not (torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])))
                changed += int(last is not None and not torch.equal(last, out[1]))
                last = out[1].clone()
            finally:
                dec.adapter.close_forward()
        res.figures = dict(replays=n, mismatches=mism, steps_with_new_cells=changed, batch=len(rids))
        if mism:
            res.fail(f"{mism} of {n} replays differ from eager")
        if not changed:
            res.fail("the resident cells never changed between replays (the check saw no Level-1 update)")
        res.summary = f"{n} replays, {mism} differ from eager, cells changed on {changed} steps"
        return res
    finally:
        dec.close()


CHECKS = {"steps": check_steps, "graph": check_graph}


def render_md(env: dict, results: list[Check]) -> str:
    lines = [f"# Serving adapter on one device (`scripts/{PROG}.py`)", "", f"{env['date']}; device {env['device']}; "
             f"torch {env['torch']}.", ""]  # fmt: skip
    for r in results:
        lines += [f"## {r.name}: {r.title}", "", f"**{'PASS' if r.ok else 'FAIL'}**: {r.summary}", ""]
        lines += [f"- FAILED: {f}" for f in r.failures] + [f"- {k}: {v}" for k, v in r.figures.items()] + [""]
    return "\n".join(lines)


def write(out: str, env: dict, results: list[Check]) -> None:
    os.makedirs(out, exist_ok=True)
    doc = dict(env, ok=all(r.ok for r in results), checks={r.name: r.__dict__ for r in results})
    for name, text in (
        ("results.json", json.dumps(doc, indent=1, default=str) + "\n"),
        ("results.md", render_md(env, results)),
    ):
        tmp = os.path.join(out, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--out", default=None, help="folder for results.json / results.md (default docs/gpu/serving on CUDA)"
    )
    p.add_argument("--only", default="steps,graph", help="comma-separated checks (default steps,graph)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="print tracebacks of checks that raise")
    args = p.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    if not only or any(c not in CHECKS for c in only):
        print(f"{PROG}: --only {args.only!r}: choose from {','.join(CHECKS)}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"{PROG}: --device cuda: torch {torch.__version__} sees no CUDA device (use --device cpu)", file=sys.stderr
        )
        return 2
    device = torch.device(args.device)
    sz = Sizes.pick(device)
    out = (
        args.out
        if args.out is not None
        else (os.path.join(ROOT, "docs", "gpu", "serving") if device.type == "cuda" else None)
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    env = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=name, torch=torch.__version__, sizes=sz.__dict__
    )
    print(f"{PROG}: {name}, torch {torch.__version__}; checks {','.join(only)}", flush=True)
    results = []
    for c in only:
        t0 = time.perf_counter()
        try:
            r = CHECKS[c](sz, device, args.seed)
        except Exception as e:  # a crash is that check's failure; the others still run
            r = Check(c, f"check {c}")
            r.fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            r.summary = "raised before finishing"
            if args.debug:
                traceback.print_exc()
        results.append(r)
        print(f"[{c}] {'PASS' if r.ok else 'FAIL'} {time.perf_counter() - t0:.1f}s: {r.summary}", flush=True)
        for f in r.failures[:5]:
            print(f"    failed: {f}", flush=True)
        if out:
            write(out, env, results)
    ok = all(r.ok for r in results)
    print(
        f"{PROG}: {'all checks passed' if ok else 'a check FAILED'}" + (f"; results in {out}/" if out else ""),
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
