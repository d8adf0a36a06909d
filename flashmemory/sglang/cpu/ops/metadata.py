"""DSv4's per-token compression metadata, in torch: the drop-in for sglang's Triton kernel
`kernels/ops/attention/dsv4/metadata_kernel.py::init_compression_metadata`.

On CPU that kernel runs in Triton's interpreter, one program per query token, and took about a third of a
1K-token prefill forward; this is the same integer arithmetic vectorised over the batch. Rows are query tokens.
For ratio r in (4, 128) and a row with seq_len L, position p and cache-write location w:
- out_loc = w // r where L % r == 0 (a compressed entry is written at this token), else 0 (int64; write rows only);
- positions = p rounded down to a multiple of r; seq_lens_raw = L // r; seq_lens_clamp1 = max(L // r, 1) (int32);
- c128 page indices [rows, (page_size / 128) * max_pages] (int32): column j is the pool slot of the row's j-th
  c128 entry, page_table[row, j // c] * c + j % c with c = page_size / 128, or -1 at j >= L // 128.
"""

from __future__ import annotations

import torch


def _ratio(
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    r: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = raw_out_loc.shape[0]
    lens = seq_lens.to(torch.int64)
    writes = lens[:n] % r == 0
    # the kernel's integer division truncates toward zero (C semantics); padding locations may be negative
    out_loc = torch.where(writes, torch.div(raw_out_loc.to(torch.int64), r, rounding_mode="trunc"), 0)
    pos = (positions.to(torch.int64) & ~(r - 1)).to(torch.int32)
    raw = (lens // r).to(torch.int32)
    return out_loc, pos, raw, raw.clamp_min(1)


def init_compression_metadata(
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: torch.Tensor | None = None,
    page_size: int = 0,
    compute_page_indices: bool = True,
) -> tuple:
    """seq_lens [B] int32, positions [B], raw_out_loc [N <= B] int64, page_table [B, max_pages] int32 ->
    (c4_out_loc [N] int64, c4_positions, c4_seq_lens_raw, c4_seq_lens_clamp1 [B] int32, the same four for c128,
    c128_page_indices [B, (page_size // 128) * max_pages] int32 or None when not `compute_page_indices`)."""
    if raw_out_loc.shape[0] > seq_lens.shape[0]:
        raise ValueError(f"raw_out_loc has {raw_out_loc.shape[0]} rows, expected at most {seq_lens.shape[0]}")
    c4 = _ratio(seq_lens, positions, raw_out_loc, 4)
    c128 = _ratio(seq_lens, positions, raw_out_loc, 128)
    pages = None
    if compute_page_indices:
        if page_table is None or page_size < 128 or page_size % 128:
            raise ValueError("compute_page_indices needs a page_table and a page_size that is a multiple of 128")
        c = page_size // 128
        cols = torch.arange(c * page_table.shape[1], device=seq_lens.device)
        slots = page_table.to(torch.int64)[:, cols // c] * c + cols % c
        valid = cols.view(1, -1) < c128[2].to(torch.int64).view(-1, 1)
        pages = torch.where(valid, slots, -1).to(torch.int32)
    return (*c4, *c128, pages)
