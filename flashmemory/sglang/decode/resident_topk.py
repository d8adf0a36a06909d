"""Level-2 tensor logic: plain functions on sglang's paged c4 layout, testable on CPU.

Terms (one c4 layer, one decode step, B rows):
  page_table  [B, P] int32   physical c4 page of each logical page (64 chunks per page), -1/0 past the end
  seq_lens    [B]    int32   chunks of history per row
  pool loc    page_table[b, j // 64] * 64 + j % 64: the chunk's slot in the c4 pool (what top-k returns)
  lut         [n_locs + 1] int32  pool loc -> reserve cell, -1 = not resident; the last entry is a -1 sentinel
Everything here is shape-static and host-sync free, so it can run inside a CUDA graph.
"""

from __future__ import annotations

import torch

from flashmemory.retriever.fp8 import FP8
from flashmemory.retriever.model import relu_head_scores

PAGE_CHUNKS = 64


def pool_locs(page_table: torch.Tensor, n_cols: int, page_chunks: int = PAGE_CHUNKS) -> torch.Tensor:
    """Int64 [B, n_cols]: pool loc of logical chunk column j; columns past the table map to loc of page 0."""
    j = torch.arange(n_cols, device=page_table.device)
    page = (j // page_chunks).clamp_max(page_table.shape[1] - 1)
    phys = page_table.long().clamp_min(0)[:, page]
    return phys * page_chunks + (j % page_chunks)


def apply_resident_mask(
    logits: torch.Tensor, page_table: torch.Tensor, resident: torch.Tensor, page_chunks: int = PAGE_CHUNKS
) -> torch.Tensor:
    """Mask mode, in place: logits[b, j] = -inf where chunk j of row b is not resident.

    logits: [B, N] float (the native indexer logits, before top-k); resident: Bool [n_locs] indexed by pool loc.
    Returns logits. Rows with history <= index_topk are still taken whole by sglang's top-k; `remap_to_cells`
    turns their non-resident picks into -1 so attention skips them.
    """
    locs = pool_locs(page_table, logits.shape[1], page_chunks).clamp_max(resident.numel() - 1)
    logits.masked_fill_(~resident[locs], float("-inf"))
    return logits


def resident_view(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sel_pages: torch.Tensor,
    tail_pages: int = 1,
    page_chunks: int = PAGE_CHUNKS,
    full: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score-resident mode: the page table and lengths the native scorer sees instead of the full history.

    sel_pages: [B, K] int64 logical pages chosen by Level 1, ascending, -1 padded. The newest `tail_pages`
    logical pages of each row are always added (decode-time chunks arrive there between Level-1 cycles).
    Returns (view_table [B, P] int32 physical pages in ascending logical order, padded with the row's first
    page; view_lens [B] int32 chunk columns). Only the row's last logical page can be partial and it sorts
    last, so the columns are exactly the resident chunks; top-k over them maps through view_table straight to
    pool locs.

    Why P columns (the full table's width), not K + tail_pages: sglang sizes the logits it hands to top-k from
    the table's width (`max_compressed_seq_len`), and `torch.topk(sorted=False)` breaks ties among equal
    scores differently for a different width. With every page resident the view's columns are the full
    table's, so the same width makes the logits and the picks bit-identical to stock (full budget = stock's
    tokens); a narrower view flipped tied picks past the 512th chunk. At most P pages can be valid (a row's
    history fits its table), so nothing is cut. Cost: the scorer's output buffer is as wide as stock's.

    full: bool [B] or None; rows where it is True see their whole history (page_table and seq_lens as they
    are: stock's view), whatever sel_pages holds (a request before its first Level-1 plan, in copy mode).
    """
    b, p = page_table.shape
    k_out = p
    dev = page_table.device
    n_pages = (seq_lens.long() + page_chunks - 1) // page_chunks  # [B]
    big = torch.iinfo(torch.int64).max
    tail = n_pages.unsqueeze(1) - 1 - torch.arange(tail_pages, device=dev).unsqueeze(0)  # [B, tail]
    cand = torch.cat((sel_pages.long(), tail), dim=1)
    if cand.shape[1] < k_out:  # fewer candidates than table columns: pad with invalid pages
        cand = torch.cat((cand, torch.full((b, k_out - cand.shape[1]), -1, dtype=torch.long, device=dev)), dim=1)
    ok = (cand >= 0) & (cand < n_pages.unsqueeze(1))
    cand = torch.where(ok, cand, torch.full_like(cand, big)).sort(dim=1).values
    dup = torch.zeros_like(ok)
    dup[:, 1:] = cand[:, 1:] == cand[:, :-1]
    cand = torch.where(dup, torch.full_like(cand, big), cand).sort(dim=1).values[:, :k_out]
    valid = cand != big
    logical = torch.where(valid, cand, torch.zeros_like(cand))
    view_table = torch.gather(page_table.long(), 1, logical.clamp_max(p - 1)).to(torch.int32)
    count = valid.sum(1)  # [B]
    last = torch.gather(logical, 1, (count - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    last_fill = (seq_lens.long() - last * page_chunks).clamp(0, page_chunks)
    view_lens = torch.where(count > 0, (count - 1) * page_chunks + last_fill, torch.zeros_like(count))
    if full is not None:
        whole = full.to(torch.bool).reshape(-1, 1)
        view_table = torch.where(whole, page_table.to(torch.int32), view_table)
        view_lens = torch.where(whole.reshape(-1), seq_lens.long(), view_lens)
    return view_table, view_lens.to(torch.int32)


def remap_to_cells(locs: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Top-k pool locs [B, K] int32 (-1 = empty) -> reserve cells [B, K] int32; non-resident or empty -> -1."""
    sentinel = lut.numel() - 1
    idx = torch.where((locs >= 0) & (locs < sentinel), locs.long(), torch.full_like(locs, sentinel, dtype=torch.long))
    return lut[idx].to(torch.int32)


def paged_index_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    kv_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    head_dim: int = 128,
    page_chunks: int = PAGE_CHUNKS,
) -> torch.Tensor:
    """Index scores on sglang's paged index-K buffer: sum_h relu(q_h . k_j) * w_h * scale_j.

    q: [B, H, D] float; w: [B, H] float; kv_pages: [n_pages, 64 * (D + 4)] uint8 ([64*D fp8 | 64 x fp32 scale]);
    page_table: [B, P]; seq_lens: [B]. Returns fp32 [B, P * 64], 0 past each row's length (sglang's convention).
    """
    b, p = page_table.shape
    sb = page_chunks * head_dim
    if kv_pages.dim() != 2 or kv_pages.shape[1] != page_chunks * (head_dim + 4):
        raise ValueError(f"kv_pages {tuple(kv_pages.shape)} is not [n_pages, {page_chunks} x {head_dim + 4}]")
    rows = kv_pages[page_table.long().clamp_min(0)]  # [B, P, page_bytes]
    vals = rows[..., :sb].contiguous().view(FP8).float().view(b, p * page_chunks, head_dim)
    scale = rows[..., sb:].contiguous().view(torch.float32).reshape(b, p * page_chunks)
    out = relu_head_scores(q.float(), w.float(), vals) * scale
    valid = torch.arange(p * page_chunks, device=out.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    return out.masked_fill(~valid, 0.0)


def pad_rows(flags: torch.Tensor, bs: int) -> torch.Tensor:
    """Bool [bs]: per-row flags of the batch's real rows, False for padding rows past them."""
    if flags.shape[0] >= bs:
        return flags[:bs]
    return torch.cat((flags, torch.zeros(bs - flags.shape[0], dtype=torch.bool, device=flags.device)))
