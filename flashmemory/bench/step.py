"""`flashmemory bench step`: host work the sglang adapter adds to every decode step, copy mode vs shrink mode.

Both adapters run in one process on the same synthetic pool (sglang's c4 page layout, 21 layers): B requests
admitted with H tokens of history, then S decode steps in which every request advances one token (so a
quarter of the steps close a c4 chunk per request, as in serving). Timed: `begin_step` plus shrink mode's
`settle`, the eager work around each forward (Level 1 excluded: it runs on its own cadence and thread). On
CPU the "device" tensors are host tensors, so the copies cost memory bandwidth, not PCIe; the ratio between
the modes is the figure to read, not the absolute milliseconds.
"""

from __future__ import annotations

import argparse
import logging
import time
import types

import torch

from flashmemory.env import FlashMemoryEnv


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="16 requests, 24 steps")
    p.add_argument("--rows", type=int, default=128, help="concurrent requests (default 128)")
    p.add_argument("--history", type=int, default=4096, help="tokens of history per request (default 4096)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed (default 64)")
    p.add_argument("--layers", type=int, default=21)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")


def _pool(layers: int, n_pages: int) -> types.SimpleNamespace:
    kv = [torch.zeros(n_pages, 37440, dtype=torch.uint8) for _ in range(layers)]
    ix = [torch.zeros(n_pages, 8448, dtype=torch.uint8) for _ in range(layers)]
    c4 = types.SimpleNamespace(kv_buffer=kv, page_size=64)
    ixp = types.SimpleNamespace(index_k_with_scale_buffer=ix, page_size=64, index_head_dim=128)
    return types.SimpleNamespace(
        c4_kv_pool=c4, c4_indexer_kv_pool=ixp, page_size=256, layer_mapping=[(4, i, c4) for i in range(layers)]
    )


def _time_mode(shrink: bool, rows: int, history: int, steps: int, layers: int) -> list[float]:
    from flashmemory.sglang.engine_adapter import SGLangOffload
    from flashmemory.sglang.shrink import ShrunkOffload

    pages = -(-(history + steps) // 256) + 1
    env = FlashMemoryEnv(
        decode_swap_p=True,
        retriever_layers=(min(10, layers - 1),),
        page_kmax=8,
        reserve_pages=rows * 9,
        decode_max_conc=rows,
        async_recall=False,
        target_context=256 * pages,
    )
    pool = _pool(layers, rows * pages + 2)
    eng = ShrunkOffload(pool, env, n_landing=64) if shrink else SGLangOffload(pool, env)
    table = torch.tensor([[1 + r * pages + j for j in range(pages)] for r in range(rows)])
    rids = [f"r{r}" for r in range(rows)]
    settle = getattr(eng, "settle", lambda: None)
    eng.begin_step(rids, table, torch.full((rows,), history))  # admission, not timed
    settle()
    out = []
    for s in range(1, steps + 1):
        t = time.perf_counter()
        eng.begin_step(rids, table, torch.full((rows,), history + s))
        settle()
        out.append(time.perf_counter() - t)
    eng.close()
    return sorted(out)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows, steps = (16, 24) if args.quick else (args.rows, args.steps)
    logging.getLogger("flashmemory").setLevel(logging.ERROR)  # the shrink's "saves no memory" warning at toy sizes
    res = {name: _time_mode(name == "shrink", rows, args.history, steps, args.layers) for name in ("copy", "shrink")}
    med = {k: v[len(v) // 2] for k, v in res.items()}
    mean = {k: sum(v) / len(v) for k, v in res.items()}
    print(
        f"adapter host work per decode step: {rows} requests x {args.history} tokens, {args.layers} c4 layers, "
        f"{steps} steps, {torch.get_num_threads()} thread(s)"
    )
    print(f"{'mode':8} {'median ms':>10} {'mean ms':>9} {'p90 ms':>8}")
    for k, v in res.items():
        print(f"{k:8} {1e3 * med[k]:10.2f} {1e3 * mean[k]:9.2f} {1e3 * v[int(0.9 * (len(v) - 1))]:8.2f}")
    print(f"shrink / copy (mean): {mean['shrink'] / mean['copy']:.2f}x")
    return 0
