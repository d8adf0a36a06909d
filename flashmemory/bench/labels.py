"""`flashmemory bench labels`: golden-label construction and lookahead unions vs plain Python loops.

Shapes default to full size: 21 c4 layers, 512-way top-k, N = 65,536 visible chunks per token.
Logits are a shared per-token signal plus per-layer noise, so layers agree often enough for votes
to pass min_layers, as real indexer logits do. Both implementations run in the same process on the
same data; the baseline runs on a prefix of the tokens (it is slow) and must give identical rows.
"""

from __future__ import annotations

import argparse
import time

import torch

from flashmemory.labels import LabelsCSR, golden_labels, lookahead_union_all


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes (N=8192, fewer tokens)")
    p.add_argument("--layers", type=int, default=21)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--n-chunks", type=int, default=None, help="visible chunks per token (default 65536)")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens for the vectorized run")
    p.add_argument("--baseline-tokens", type=int, default=None, help="tokens for the Python-loop baseline")
    p.add_argument("--topp", type=float, default=0.6)
    p.add_argument("--min-layers", type=int, default=3)
    p.add_argument("--tau", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for both runs (default: torch's; 1 is fairer on a busy machine)",
    )


def loop_golden(
    layer_logits: list[torch.Tensor], topk: int, topp: float, min_layers: int
) -> list[list[tuple[int, int]]]:
    """The straightforward implementation: per token, per layer, top-k + softmax + a Python nucleus loop."""
    rows = []
    for t in range(layer_logits[0].shape[0]):
        votes: dict[int, int] = {}
        for lg in layer_logits:
            row = lg[t]
            k = min(topk, int(torch.isfinite(row).sum()))
            if k == 0:
                continue
            vals, idx = torch.topk(row, k)
            probs = torch.softmax(vals, 0).tolist()
            ids = idx.tolist()
            c = 0.0
            for i in range(k):
                if i > 0 and c > topp:
                    break
                c += probs[i]
                votes[ids[i]] = votes.get(ids[i], 0) + 1
        rows.append(sorted(((j, v) for j, v in votes.items() if v >= min_layers), key=lambda e: (-e[1], e[0])))
    return rows


def loop_union(rows: list[list[tuple[int, int]]], t_count: int, tau: int) -> list[list[tuple[int, int]]]:
    out = []
    for t in range(t_count):
        best: dict[int, int] = {}
        for s in range(t, min(t + tau, len(rows))):
            for j, v in rows[s]:
                if v > best.get(j, 0):
                    best[j] = v
        out.append(sorted(best.items()))
    return out


def _timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.n_chunks or (8192 if args.quick else 65536)
    T = args.tokens or (16 if args.quick else 64)
    Tb = min(T, args.baseline_tokens or (4 if args.quick else 8))
    g = torch.Generator().manual_seed(args.seed)
    base = torch.randn(T, n, generator=g) * 2.0
    logits = [base + torch.randn(T, n, generator=g) for _ in tqdm(range(args.layers), desc="logits", leave=False)]

    fast, t_fast = _timed(golden_labels, logits, args.topk, args.topp, args.min_layers)
    slow, t_slow = _timed(loop_golden, [lg[:Tb] for lg in logits], args.topk, args.topp, args.min_layers)
    match_g = fast.to_rows()[:Tb] == slow

    # Lookahead union on a synthetic long label stream (a few dozen labels per token).
    Tu = 512 if args.quick else 4096
    per = 48
    cnt = torch.randint(per // 2, per * 3 // 2, (Tu,), generator=g)
    rows_t = torch.repeat_interleave(torch.arange(Tu), cnt)
    walk = (torch.arange(Tu) * (n // Tu)).repeat_interleave(cnt)  # labels drift with the token, as in decode
    idx = (walk + torch.randint(0, max(2, n // 8), (rows_t.numel(),), generator=g)) % n
    sc = torch.randint(args.min_layers, args.layers + 1, (rows_t.numel(),), generator=g)
    key = torch.unique(rows_t * n + idx)
    csr = LabelsCSR.from_entries(key // n, key % n, sc[: key.numel()], Tu)
    rows_py = csr.to_rows()
    Tub = 64 if args.quick else 256
    u_fast, t_ufast = _timed(lookahead_union_all, csr, args.tau)
    u_slow, t_uslow = _timed(loop_union, rows_py, Tub, args.tau)
    match_u = u_fast.to_rows()[:Tub] == u_slow

    print(
        f"labels: {args.layers} layers, top-{args.topk}, N={n}, topp={args.topp}, min_layers={args.min_layers}; "
        f"{fast.indices.numel() / max(T, 1):.1f} golden chunks/token; union tau={args.tau} over {Tu} tokens; "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print(f"{'stage':<22}{'impl':<26}{'tokens':>8}{'seconds':>10}{'tok/s':>12}{'ratio':>9}  match")
    rf, rs = T / t_fast, Tb / t_slow
    print(f"{'golden labels':<22}{'per-layer/token loop':<26}{Tb:>8}{t_slow:>10.3f}{rs:>12.1f}{1.0:>9.2f}")
    print(f"{'':<22}{'vectorized (all tokens)':<26}{T:>8}{t_fast:>10.3f}{rf:>12.1f}{rf / rs:>9.2f}  {match_g}")
    uf, us = Tu / t_ufast, Tub / t_uslow
    print(f"{'lookahead union':<22}{'per-token set loop':<26}{Tub:>8}{t_uslow:>10.3f}{us:>12.1f}{1.0:>9.2f}")
    print(f"{'':<22}{'vectorized (all tokens)':<26}{Tu:>8}{t_ufast:>10.3f}{uf:>12.1f}{uf / us:>9.2f}  {match_u}")
    return 0 if match_g and match_u else 1
