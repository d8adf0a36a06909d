"""Prefetch into sglang's DeepSeek-V4 HiSparse hot buffer: the hint's sanitizing, the prefetch call and the
attribution of its hits, as torch functions (no sglang import). Wired by `flashmemory.sglang.hisparse.prefetch`.

A prefetch is the swap-in op itself (`ops.hisparse.load_cache_to_device_buffer_dsv4` on CPU, sglang's JIT kernel
on a GPU) called with a hint matrix in place of the step's top-k picks, a scratch output and `num_top_k = W`:
it loads the hinted positions that miss into the oldest slots not listed, and makes every listed one MRU. What
keeps it exact (invariants of docs/hisparse.md, section 9):
- I1/I5: a hinted position is loaded only with real bytes: `sanitize_hint` turns into -1 every position that is
  negative, at or past L-1 (the newest entry maps to the reserved slot, nothing is copied), past the host-loc
  table, or without a host loc. It is pure tensor code (no host sync), so a CUDA graph can record it.
- I7/(b): a row lists at most H-K positions. After the step's swap-in its <= K picks are the newest LRU entries;
  the prefetch's misses take the oldest non-listed slots, at most H-K of them, so they never reach the picks.
- I9: positions in a row are unique (`dedup_positions` at publish).
- I6: fast-path rows (L <= H) and padded rows are left alone by the op itself.

Attribution (`Provenance`, CPU only: the CUDA kernel does not say which slot hit): a slot a prefetch loaded is
marked with the position it loaded. After each demand swap-in of the layer, a marked slot that still holds its
position and whose position is among the step's picks was a prefetch hit (`used`); a marked slot that now holds
another position was evicted before any pick used it (`wasted`); both clear the mark. A request's marks left at
its end are counted `wasted` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmemory.sglang.cpu.ops.hisparse import ITEM_BYTES, load_cache_to_device_buffer_dsv4


def dedup_positions(positions: torch.Tensor, cap: int) -> torch.Tensor:
    """Int64 [<= cap]: the non-negative entries of `positions` (int [N], in priority order), duplicates removed
    (the first occurrence kept, order preserved), truncated to `cap`."""
    p = positions.reshape(-1).to(torch.int64)
    p = p[p >= 0]
    if p.numel() == 0 or cap <= 0:
        return p[:0]
    uniq, inverse = torch.unique(p, return_inverse=True)
    first = torch.full((uniq.numel(),), p.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(p.numel()), reduce="amin")
    return p[first.sort().values][:cap]


def sanitize_hint(
    hint: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, host_cache_locs: torch.Tensor
) -> torch.Tensor:
    """Int32 [B, W]: `hint` (int [B, W] compressed positions, -1 = none) with -1 wherever a position is < 0,
    >= L-1 (L = seq_lens[b], the row's compressed length), >= host_cache_locs.shape[1], or has host loc < 0 in
    row req_pool_indices[b] of host_cache_locs (int64 [R, N]). Device-side only: no `.item()`, no host copy."""
    h = hint.to(torch.int64)
    lens = seq_lens.to(torch.int64).reshape(-1, 1)
    width = host_cache_locs.shape[1]
    inside = (h >= 0) & (h < lens - 1) & (h < width)
    # [B, W] reads of the host-loc table only (never a copy of its [B, N] rows: N is the longest history)
    rid = req_pool_indices.to(torch.int64).reshape(-1, 1)
    host = host_cache_locs[rid, torch.where(inside, h, torch.zeros_like(h))]
    ok = inside & (host >= 0)
    return torch.where(ok, h, torch.full_like(h, -1)).to(torch.int32)


@dataclass(frozen=True)
class PrefetchCounts:
    """One prefetch call: listed = positions left after sanitizing in real rows, dropped = removed by sanitizing,
    resident = listed ones already held (made MRU, nothing copied), loaded = copied host -> device, bytes =
    loaded x 584."""

    listed: int
    dropped: int
    resident: int
    loaded: int
    bytes_h2d: int


@dataclass(frozen=True)
class AttributionCounts:
    """Prefetched slots resolved by one demand swap-in: used by its picks, or evicted before any use."""

    used: int
    wasted: int


class Provenance:
    """Per layer, request slot and buffer slot: the position a prefetch loaded there, -1 = none (int32
    [n_layers, R, H+page], on the host; CPU attribution only)."""

    def __init__(self, n_layers: int, n_rows: int, width: int) -> None:
        self.marks = torch.full((n_layers, n_rows, width), -1, dtype=torch.int32)

    def after_demand(
        self,
        layer: int,
        picks: torch.Tensor,
        req_pool_indices: torch.Tensor,
        device_buffer_tokens: torch.Tensor,
        real: int,
    ) -> AttributionCounts:
        """Resolve the marks of the first `real` rows after layer `layer`'s demand swap-in of `picks` (int
        [B, >= K]); device_buffer_tokens: int32 [R, H+page] of that layer (after the swap-in)."""
        used = wasted = 0
        marks = self.marks[layer]
        for b in range(real):
            rid = int(req_pool_indices[b])
            row = marks[rid]
            slots = torch.nonzero(row >= 0).flatten()
            if slots.numel() == 0:
                continue
            pos = row[slots]
            held = device_buffer_tokens[rid, slots].cpu().to(torch.int32)
            gone = held != pos
            hit = ~gone & torch.isin(pos, picks[b].cpu().to(torch.int32))
            wasted += int(gone.sum())
            used += int(hit.sum())
            row[slots[gone | hit]] = -1
        return AttributionCounts(used, wasted)

    def after_prefetch(
        self,
        layer: int,
        before: torch.Tensor,
        req_pool_indices: torch.Tensor,
        device_buffer_tokens: torch.Tensor,
        real: int,
    ) -> int:
        """Mark the slots a prefetch loaded (those whose position changed from `before`, int32 [B, H+page] of
        the rows' tokens before the call); returns how many still-marked slots it overwrote (wasted)."""
        wasted = 0
        marks = self.marks[layer]
        for b in range(real):
            rid = int(req_pool_indices[b])
            now = device_buffer_tokens[rid].cpu().to(torch.int32)
            loaded = torch.nonzero(now != before[b]).flatten()
            if loaded.numel():
                wasted += int((marks[rid, loaded] >= 0).sum())
                marks[rid, loaded] = now[loaded]
        return wasted

    def release(self, rid: int) -> int:
        """Forget request slot `rid` (its request ended); returns its marks never used (wasted)."""
        n = int((self.marks[:, rid] >= 0).sum())
        self.marks[:, rid] = -1
        return n


def prefetch_layer_cpu(
    hint: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    scratch_out: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    hot: int,
    real: int,
) -> PrefetchCounts:
    """One layer's prefetch on CPU, synchronously: sanitize `hint` (int [>= real, W]), then the torch swap-in op
    on it with `scratch_out` (int32 [>= B, W], never the step's output) as its output. Shapes as in
    `load_cache_to_device_buffer_dsv4`; `real` = rows that are real requests (the others are left alone)."""
    rows = hint[:real]
    w = rows.shape[1] if rows.dim() == 2 else 0
    if real == 0 or w == 0:
        return PrefetchCounts(0, 0, 0, 0, 0)
    clean = sanitize_hint(rows, req_pool_indices[:real], seq_lens[:real], host_cache_locs)
    listed_before = int((rows >= 0).sum())
    c = load_cache_to_device_buffer_dsv4(
        clean,
        device_buffer_tokens,
        host_cache_locs,
        device_buffer_locs,
        host_cache,
        device_buffer,
        scratch_out,
        req_pool_indices[:real],
        seq_lens[:real],
        lru_slots,
        w,
        hot,
        real,
    )
    listed = c.lookups
    return PrefetchCounts(listed, listed_before - int((clean >= 0).sum()), c.hits, c.misses, c.misses * ITEM_BYTES)
