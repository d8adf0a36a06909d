"""Plain-loop reference implementations of the label rules, written straight from the spec."""

import math

import torch


def brute_golden(layer_logits, topk, topp, min_layers):
    """layer_logits: list over layers of [T, N] (-inf = not visible). Returns per-token [(chunk, votes)]."""
    T = layer_logits[0].shape[0]
    rows = []
    for t in range(T):
        votes = {}
        for lg in layer_logits:
            row = lg[t].float()
            n_vis = sum(1 for x in row.tolist() if math.isfinite(x))
            k = min(topk, n_vis)
            if k == 0:
                continue
            vals, idx = torch.topk(row, k)
            c = torch.cumsum(torch.softmax(vals, 0), 0).tolist()
            keep_all = [x <= topp for x in c]
            keep_all[0] = True
            over = [i for i in range(k) if c[i] > topp]
            if over:
                keep_all[over[0]] = True  # the entry whose cumsum crosses topp
            for i in range(k):
                keep = keep_all[i]
                if keep:
                    j = int(idx[i])
                    votes[j] = votes.get(j, 0) + 1
        golden = [(j, v) for j, v in votes.items() if v >= min_layers]
        rows.append(sorted(golden, key=lambda e: (-e[1], e[0])))
    return rows


def brute_union(rows, t, tau, n_chunks=None):
    """rows: per-token [(chunk, score)]. Union over [t, t+tau) with max score, ascending chunk ids."""
    best = {}
    for s in range(t, min(t + tau, len(rows))):
        for j, v in rows[s]:
            if n_chunks is not None and j >= n_chunks:
                continue
            best[j] = max(best.get(j, 0), v)
    return sorted(best.items())
