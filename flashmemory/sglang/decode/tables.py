"""The decode step's tables, pure functions and one small holder: each row's token lengths on the host
(`host_seq_lens`), its c4 pool pages (`c4_page_table`), the PD receive's buffer substitution into the host mirror
(`substitute_buf_infos`) and the static Level-2 buffers a CUDA graph reads (`Level2Buffers`, allocated once per
process by `Runtime.level2_buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def host_seq_lens(forward_batch: Any, rids: list[str]) -> torch.Tensor:
    """Int64 [len(rids)] token lengths of the batch's rows on the host: sglang's own host copy `seq_lens_cpu`
    (kept by `prepare_for_decode`, no device sync; the guard's view zeroes its failed rows there too); one D2H
    copy only where the batch has no host copy.

    Blocking operations left on the decode thread are listed (with their cost) and counted in
    tests/sglang/decode/test_decode_blocking.py; the side band's freshness check (first forward of each batch size) is
    one more."""
    cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if cpu is None or cpu.shape[0] < len(rids):
        return forward_batch.seq_lens[: len(rids)].cpu()
    return cpu[: len(rids)].long()


def c4_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    device_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Int64 [B, P] c4 pool pages of each row: c4 page k holds the c4 entries of full-KV page k (slot = loc // 4,
    page_size // 4 slots per page), so logical page p of a row is req_to_token[row, p * page_size] // page_size.
    Columns past a row's length are -1. req_to_token: [max_reqs, max_ctx] full locs; seq_lens: [B] tokens on the
    host (the width P); device_seq_lens: the same on req_to_token's device (sglang's `seq_lens`), so the table
    is built without a host copy (without it, seq_lens is moved there)."""
    n = int(seq_lens.max()) if seq_lens.numel() else 0
    p = max(1, -(-n // page_size))
    cols = torch.arange(p, device=req_to_token.device) * page_size
    locs = req_to_token[req_pool_indices.long()][:, cols.clamp_max(req_to_token.shape[1] - 1)].long()
    lens = device_seq_lens if device_seq_lens is not None else seq_lens.to(locs.device)
    live = cols.unsqueeze(0) < lens.long().unsqueeze(1)
    return torch.where(live, torch.div(locs, page_size, rounding_mode="floor"), torch.full_like(locs, -1))


def substitute_buf_infos(
    infos: tuple[list[int], list[int], list[int]], mirror: dict[int, tuple[int, int, int]]
) -> tuple[list[int], list[int], list[int]]:
    """PD receive into the host mirror: replace (ptr, len, item_len) entries whose device ptr is a key of `mirror`."""
    ptrs, lens, items = (list(x) for x in infos)
    for i, p in enumerate(ptrs):
        if p in mirror:
            ptrs[i], lens[i], items[i] = mirror[p]
    return ptrs, lens, items


@dataclass
class Level2Buffers:
    """Static per-row residency for score-resident mode: front (read by the graph) and back (side band)."""

    sel_pages: torch.Tensor  # [max_bs, K] int64 ascending, -1 padded
    back_pages: torch.Tensor
    rids: list[str | None]

    @classmethod
    def allocate(cls, max_bs: int, kmax: int, device: torch.device | str) -> "Level2Buffers":
        z = torch.full((max_bs, kmax), -1, dtype=torch.int64, device=device)
        return cls(z, z.clone(), [None] * max_bs)

    @property
    def rows(self) -> int:
        return int(self.sel_pages.shape[0])

    def reset_rows(self, rows: list[int]) -> None:
        if rows:
            self.sel_pages[rows] = -1

    def publish(self) -> None:
        """Copy the side band's back buffer to the front, on the caller's (main) stream, between forwards."""
        self.sel_pages.copy_(self.back_pages)


class Level2CapacityError(RuntimeError):
    """A decode batch has more rows than the Level-2 buffers sized before capture (they are never reallocated)."""
