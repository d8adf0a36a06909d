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


def brute_margins(layer_logits, topk, topp):
    """Per token: how far its label decision sits from a boundary, the smallest over layers of the gap between the
    k-th and (k+1)-th visible logit and of |cumulative top-k softmax mass - topp|. A row whose margin is within
    rounding (two softmax / cumsum implementations may differ in the last bits) can legitimately differ."""
    T = layer_logits[0].shape[0]
    out = []
    for t in range(T):
        m = math.inf
        for lg in layer_logits:
            row = lg[t].double()
            vis = row[torch.isfinite(row)]
            k = min(topk, vis.numel())
            if k == 0:
                continue
            vals = torch.sort(vis, descending=True).values
            if k < vis.numel():
                m = min(m, float(vals[k - 1] - vals[k]))
            c = torch.cumsum(torch.softmax(vals[:k], 0), 0)
            m = min(m, float((c - topp).abs().min()))
        out.append(m)
    return out


def assert_rows_agree(got_rows, want_rows, margins, tol=1e-5):
    """Label rows equal, except rows whose decision margin (`brute_margins`) is within `tol`: near-ties."""
    assert len(got_rows) == len(want_rows) == len(margins)
    bad = [t for t, (g, w) in enumerate(zip(got_rows, want_rows)) if g != w and not margins[t] <= tol]
    assert not bad, f"label rows differ at tokens {bad[:5]} (margins {[margins[t] for t in bad[:5]]}): not near-ties"
