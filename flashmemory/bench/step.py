"""`flashmemory bench step`: host time and blocking operations per decode step of the serving hooks, per mode,
beside the adapter off.

Each mode runs the hooks sglang calls in one decode step (`step_drive.step`: the guard's admission check,
`before_forward`, the per-layer indexer / store / refresh hooks, `after_decode_forward` with Level 1) on a
synthetic pool with sglang's c4 page layout: R requests with H tokens of history arrive at once in sglang's PD
decode waiting queue, then S decode steps follow in which every running request advances one token (a quarter of
them close a c4 chunk per request; Level-1 cycles come due every tau steps). The requests join the running batch
through the queue's Patch row (`queue_gate.around_prebuilt_batch`, around a stand-in for sglang's
`_get_new_prebuilt_batch` that takes every free slot's worth), which holds each step to its warm-start budget:
the admitting step (the first) admits the leading requests whose warm pages fit `warm_step_pages`, the others
join on the steps after it (columns `admitted`: at the first step, `queue steps`: until the queue is empty;
`quiet us` and `quiet blocking`: the steps after that, which admit nothing).
Modes: `off` (the runtime's hooks with no adapter: stock sglang, which admits the whole queue at once),
`copy`, `shrink`, and `shrink-tp2` (shrink mode with tensor-parallel lockstep publishing, as one rank runs it).

Two figures per mode, each from its own pass: host µs per step (plain CPU tensors, no stand-in; on CPU the
"device" tensors are host tensors, so read the ratio to `off`, not the absolute time), and blocking operations
per step on the decode thread, counted with the CUDA stand-in (`standin_blocking`: host reads of device values,
copies from pageable host memory, synchronizes) — each one is a point where a GPU server's overlap scheduler
would drain. The admitting step (the first) is reported apart from the steps after it.
"""

from __future__ import annotations

import argparse
import logging
import types
from typing import Any

import torch

from flashmemory.bench import standin_blocking, standin_streams
from flashmemory.bench import step_drive as sd
from flashmemory.sglang.decode import queue_gate

MODES = ("off", "copy", "shrink", "shrink-tp2")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="8 requests x 512 tokens, 16 steps, 4 layers")
    p.add_argument("--rows", type=int, default=128, help="concurrent requests (default 128)")
    p.add_argument("--history", type=int, default=1024, help="tokens of history per request (default 1024)")
    p.add_argument("--steps", type=int, default=32, help="decode steps after the admitting one (default 32)")
    p.add_argument("--layers", type=int, default=21, help="c4 layers (default 21, DeepSeek-V4's)")
    p.add_argument("--tau", type=int, default=8, help="Level-1 cycle interval in steps (default 8)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")


def _queue(world: sd.World, rows: int, history: int) -> Any:
    """sglang's PD decode waiting queue holding `rows` arrivals of `history` tokens. Returns `join`: one scheduler
    pass through the queue's Patch row (its taker admits every free slot's worth, `sd.admit`), -> requests joined."""
    reqs = [
        types.SimpleNamespace(
            rid=f"r{r}", kv=types.SimpleNamespace(req_pool_idx=1 + r), origin_input_ids=range(history)
        )
        for r in range(rows)
    ]
    sched = types.SimpleNamespace(
        waiting_queue=reqs,
        req_to_token_pool=types.SimpleNamespace(size=rows, req_to_token=world.r2t),
        max_running_requests=rows,
    )
    running = types.SimpleNamespace(batch_size=lambda: len(world.seqs))

    def take(self: Any, running_batch: Any) -> None:
        n = max(0, rows - running_batch.batch_size())
        for r in self.waiting_queue[:n]:
            sd.admit(world, r.rid, history)
        self.waiting_queue = self.waiting_queue[n:]

    def join() -> int:
        before = len(world.seqs)
        queue_gate.around_prebuilt_batch(take, sched, running)
        return len(world.seqs) - before

    return join


def _run(mode: str, rows: int, history: int, steps: int, layers: int, tau: int, count: bool) -> list[tuple]:
    """Per step (admitting step first): (host seconds, blocking operations on the decode thread, requests that
    joined before it)."""
    patches = standin_blocking.Patches()
    if count:
        standin_streams.install(patches)
        standin_blocking.count_transfers(patches)
    if mode.endswith("-tp2"):
        from flashmemory.sglang.decode import offload_adapter

        patches(offload_adapter, "serving_tp_size", lambda: 2)
    base = mode.split("-")[0]
    world = None
    try:
        pages = -(-(history + steps + 1) // sd.PAGE) + 1
        world = sd.build_world(base, rows, pages, layers, interval=tau)
        patches(queue_gate, "RUNTIME", world.rt)  # the gate reads the world's adapter and decode-step count
        join = _queue(world, rows, history)
        out = []
        for _ in range(steps + 1):
            joined = join()
            dt, got = sd.step(world)
            out.append((dt, len(got), joined))
        return out
    finally:
        if world is not None:
            sd.close(world)
        patches.undo()


def _stats(per_step: list[tuple]) -> dict[str, float]:
    """Host µs of the admitting step and of the steps after it; of those, the quiet ones (after the last step a
    request joined: no admission; nan when the queue never empties), and how the queue emptied."""
    rest = per_step[1:] or per_step
    last = max(k for k, s in enumerate(per_step) if s[2])
    quiet = per_step[last + 1 :]
    return {
        "admit_us": 1e6 * per_step[0][0],
        "step_us": 1e6 * sum(t for t, *_ in rest) / len(rest),
        "quiet_us": 1e6 * sum(t for t, *_ in quiet) / len(quiet) if quiet else float("nan"),
        "admitted": per_step[0][2],
        "queue_steps": last + 1,
    }


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows, steps, layers = (8, 16, 4) if args.quick else (args.rows, args.steps, args.layers)
    history = 512 if args.quick else args.history
    logging.getLogger("flashmemory").setLevel(logging.ERROR)  # the shrink's "saves no memory" warning at toy sizes
    res: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        timed = _stats(_run(mode, rows, history, steps, layers, args.tau, count=False))
        counted = _run(mode, rows, history, steps, layers, args.tau, count=True)
        rest = counted[1:] or counted
        quiet = counted[timed["queue_steps"] :]
        res[mode] = {
            **timed,
            "admit_blocking": float(counted[0][1]),
            "step_blocking": sum(n for _, n, _ in rest) / len(rest),
            "quiet_blocking": sum(n for _, n, _ in quiet) / len(quiet) if quiet else float("nan"),
        }
    print(
        f"decode-step hooks: {rows} requests x {history} tokens, {layers} c4 layers, {steps} steps after the "
        f"admitting one, tau {args.tau}, {torch.get_num_threads()} thread(s); blocking = operations a GPU host "
        "waits on, decode thread"
    )
    off = res["off"]
    print(
        f"{'mode':11} {'step us':>9} {'x off':>7} {'blocking/step':>14} {'admit us':>10} {'x off':>7} "
        f"{'blocking@admit':>15} {'admitted':>8} {'queue steps':>11} {'quiet us':>9} {'quiet blocking':>14}"
    )
    for mode, r in res.items():
        print(
            f"{mode:11} {r['step_us']:9.0f} {r['step_us'] / max(off['step_us'], 1e-9):7.1f} "
            f"{r['step_blocking']:14.1f} {r['admit_us']:10.0f} {r['admit_us'] / max(off['admit_us'], 1e-9):7.1f} "
            f"{r['admit_blocking']:15.0f} {r['admitted']:8d} {r['queue_steps']:11d} {r['quiet_us']:9.0f} "
            f"{r['quiet_blocking']:14.1f}"
        )
    return 0
