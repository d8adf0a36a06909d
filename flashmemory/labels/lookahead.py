"""Lookahead union: the chunks golden anywhere in the window [t, t+tau) (current token included).

This is what a retriever trained for a tau-step cycle must make resident at step t; the dump stores
per-token labels and readers take the union (upstream's dataloader with label_interval=64).
The union's score for a chunk is its maximum vote count inside the window.
"""

from __future__ import annotations

import torch

from flashmemory.labels.csr import LabelsCSR, LabelsError

# Expanded (entry, offset) pairs processed per block in `lookahead_union_all`; bounds peak memory.
_BLOCK_PAIRS = 1 << 23


def _limit(n_chunks: int | torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    if n_chunks is None:
        return None
    if isinstance(n_chunks, int):
        return torch.full_like(rows, n_chunks)
    return torch.as_tensor(n_chunks).long()[rows]


def lookahead_union(
    labels: LabelsCSR, t: int, tau: int = 64, n_chunks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Union for one token: (chunk ids [U] int64 ascending, max votes [U] int32). Chunks >= n_chunks dropped."""
    if tau < 1:
        raise LabelsError(f"tau={tau} must be >= 1")
    if not 0 <= t < labels.n_tokens:
        raise IndexError(f"token {t} outside [0, {labels.n_tokens})")
    a = int(labels.pointers[t])
    b = int(labels.pointers[min(t + tau, labels.n_tokens)])
    idx = labels.indices[a:b].long()
    sc = labels.scores[a:b]
    if n_chunks is not None:
        m = idx < n_chunks
        idx, sc = idx[m], sc[m]
    uniq, inv = torch.unique(idx, return_inverse=True)
    best = torch.zeros(uniq.numel(), dtype=torch.int32).scatter_reduce(0, inv, sc, "amax", include_self=False)
    return uniq, best


def lookahead_union_all(labels: LabelsCSR, tau: int = 64, n_chunks: int | torch.Tensor | None = None) -> LabelsCSR:
    """Unions for every token at once, as a CSR with T rows (chunk ids ascending, score = max votes).

    n_chunks: an int, or a [T] tensor giving row t's limit, drops chunk ids >= the limit (e.g. the
    chunks that exist in the dumped keys). Work is O(entries x tau), done in blocks of target rows.
    """
    if tau < 1:
        raise LabelsError(f"tau={tau} must be >= 1")
    T = labels.n_tokens
    if labels.indices.numel() == 0 or T == 0:
        return LabelsCSR.empty(T)
    src_row = labels.row_ids()
    col = labels.indices.long()
    score = labels.scores
    width = int(col.max()) + 1
    ptr = labels.pointers.long()
    per_row = max(1, labels.indices.numel() // max(T, 1))
    block = max(tau, _BLOCK_PAIRS // (per_row * tau))
    offs = torch.arange(tau)
    out_r, out_c, out_s = [], [], []
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        a, b = int(ptr[t0]), int(ptr[min(T, t1 + tau - 1)])
        s, c, v = src_row[a:b], col[a:b], score[a:b]
        tgt = s.unsqueeze(1) - offs.unsqueeze(0)  # [e, tau] target rows
        ok = (tgt >= t0) & (tgt < t1)
        tgt_f = tgt[ok]
        c_f = c.unsqueeze(1).expand_as(tgt)[ok]
        v_f = v.unsqueeze(1).expand_as(tgt)[ok]
        lim = _limit(n_chunks, tgt_f)
        if lim is not None:
            m = c_f < lim
            tgt_f, c_f, v_f = tgt_f[m], c_f[m], v_f[m]
        if tgt_f.numel() == 0:
            continue
        uniq, inv = torch.unique(tgt_f * width + c_f, return_inverse=True)
        best = torch.zeros(uniq.numel(), dtype=torch.int32).scatter_reduce(0, inv, v_f, "amax", include_self=False)
        out_r.append(uniq // width)
        out_c.append(uniq % width)
        out_s.append(best)
    if not out_r:
        return LabelsCSR.empty(T)
    return LabelsCSR.from_entries(torch.cat(out_r), torch.cat(out_c), torch.cat(out_s), T)
