"""Torch versions of the ops sglang 0.5.23's DeepSeek-V4 HiSparse path runs on CUDA (no sglang import).

Written from the semantics of `kernels/jit/csrc/kvcacheio/hisparse.cuh` (`load_cache_to_device_buffer_kernel`
:355-722, `transfer_cache_dsv4_mla` :227-286) and `kernels/jit/include/sgl_kernel/deepseek_v4/kvcacheio.cuh`
(page layout :12-76); see docs/hisparse.md. Wired into sglang by `../patches_hisparse.py`.

c4 page row (device pool and host pool alike, uint8): 64 token values of 576 B, then 64 scales of 8 B, padded to
a multiple of 576 B -> 37,440 B per page. Token `loc` lives in page loc // 64, slot loc % 64. One token is 584 B
in two runs, so it is never one contiguous range.

Hot buffer (per c4 layer, per request slot `rid`): `hot` LRU slots plus one reserved slot `hot` that holds the
newest compressed entry. `device_buffer_tokens[rid, s]` is the compressed position held by slot s (-1: empty),
`device_buffer_locs[rid, s]` its c4 device loc, `lru_slots[rid, :hot]` the slots oldest-first (int16).

Swap-in per request and step (compressed length L, top-k picks t_0..t_{K-1}, in order):
- padded row (batch index >= num_real_reqs): all K outputs = -1.
- fast path L <= hot: output i = locs[t_i] for i < min(L, K) and t_i >= 0, else -1. Nothing moves.
- else: t_i == L-1 -> locs[hot] (reserved slot); t_i == -1 counts as a hit and its output is left as found;
  an LRU slot whose token is among the picks is a hit (output = its loc); the misses, in pick order, take the
  non-hit slots oldest-first, are copied host -> device and recorded in `device_buffer_tokens`; the new LRU is
  [remaining non-hit slots (old order), just-loaded slots (pick order), hit slots (old order)].
Duplicate picks are a race in the CUDA kernel; here the first occurrence may hit and later ones miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

C4_PAGE = 64
VALUE_BYTES = 576
SCALE_BYTES = 8
ITEM_BYTES = VALUE_BYTES + SCALE_BYTES  # 584
SCALE_OFFSET = VALUE_BYTES * C4_PAGE  # 36,864
PAGE_BYTES = -(-ITEM_BYTES * C4_PAGE // VALUE_BYTES) * VALUE_BYTES  # 37,440


@dataclass(frozen=True)
class RequestPlan:
    """One request's swap-in decision for one layer.

    out_locs: int32 [K], the device loc per pick (-1 where nothing; None where the kernel leaves it unwritten,
    encoded by `written` False). miss_src: int64 [M] host locs; miss_dst: int32 [M] device locs; new_lru: int16 [hot]
    or None on the fast path; loaded_slots/loaded_tokens: the slots that took a miss and the positions they hold.
    """

    out_locs: torch.Tensor
    written: torch.Tensor
    hits: int
    misses: int
    miss_src: torch.Tensor
    miss_dst: torch.Tensor
    loaded_slots: torch.Tensor
    loaded_tokens: torch.Tensor
    new_lru: torch.Tensor | None


@dataclass(frozen=True)
class SwapInCounts:
    """Counters of one swap-in call (sglang keeps none): lookups, hits (the reserved newest slot included),
    misses = tokens copied host -> device, bytes = misses * 584. Fast-path and padded requests count no lookup."""

    lookups: int
    hits: int
    misses: int
    bytes_h2d: int


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != PAGE_BYTES:
        raise ValueError(f"{name}: expected uint8 [pages, {PAGE_BYTES}], got {cache.dtype} {tuple(cache.shape)}")


def token_byte_offsets(locs: torch.Tensor) -> torch.Tensor:
    """Flat byte offsets of tokens `locs` (int [N], >= 0) in a page-padded c4 cache: int64 [N, 584], the 576
    value bytes then the 8 scale bytes of each token."""
    locs = locs.to(torch.int64)
    page, slot = locs // C4_PAGE, locs % C4_PAGE
    base = page * PAGE_BYTES
    value = (base + slot * VALUE_BYTES)[:, None] + torch.arange(VALUE_BYTES, dtype=torch.int64)
    scale = (base + SCALE_OFFSET + slot * SCALE_BYTES)[:, None] + torch.arange(SCALE_BYTES, dtype=torch.int64)
    return torch.cat([value, scale], dim=1)


def copy_c4_tokens(src: torch.Tensor, dst: torch.Tensor, src_locs: torch.Tensor, dst_locs: torch.Tensor) -> None:
    """dst token dst_locs[i] <- src token src_locs[i] (584 B each, value and scale runs), in place.

    src, dst: uint8 [pages, 37440] (contiguous); locs: int [N] >= 0, same length. Other bytes are not touched.
    """
    _check_cache("src", src)
    _check_cache("dst", dst)
    if src_locs.numel() != dst_locs.numel():
        raise ValueError(f"copy_c4_tokens: {src_locs.numel()} source locs vs {dst_locs.numel()} destination locs")
    if src_locs.numel() == 0:
        return
    for name, locs, cache in (("src_locs", src_locs, src), ("dst_locs", dst_locs, dst)):
        if int(locs.min()) < 0 or int(locs.max()) >= cache.shape[0] * C4_PAGE:
            raise ValueError(f"copy_c4_tokens: {name} outside [0, {cache.shape[0] * C4_PAGE})")
    src_off = token_byte_offsets(src_locs.reshape(-1).to(src.device))
    dst_off = token_byte_offsets(dst_locs.reshape(-1).to(dst.device))
    dst.view(-1)[dst_off.reshape(-1)] = src.view(-1)[src_off.reshape(-1)].to(dst.device)


def transfer_cache_dsv4(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
) -> None:
    """sglang's `transfer_cache_dsv4_mla` on tensors instead of pointer tables: for every layer l and item i,
    dst_caches[l] token dst_indices[i] <- src_caches[l] token src_indices[i]. Used for the per-token backup
    (device -> host, all c4 layers) and the token-granular preload (host -> device, one layer)."""
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"transfer_cache_dsv4: {len(src_caches)} source layers vs {len(dst_caches)} destination")
    for s, d in zip(src_caches, dst_caches):
        copy_c4_tokens(s, d, src_indices, dst_indices)


def plan_request(
    picks: torch.Tensor,
    seq_len: int,
    buffer_tokens: torch.Tensor,
    buffer_locs: torch.Tensor,
    host_locs: torch.Tensor,
    lru: torch.Tensor,
    hot: int,
    num_top_k: int,
) -> RequestPlan:
    """Hot-buffer lookup and miss planning for one request (no state is changed).

    picks: int [>= num_top_k] compressed positions; buffer_tokens / buffer_locs: int32 [hot + page] of this
    request; host_locs: int64 [>= seq_len] host loc per compressed position; lru: int16 [hot].
    """
    k = num_top_k
    picks = picks[:k].to(torch.int64)
    empty64, empty32 = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32)
    if seq_len <= hot:
        count = min(seq_len, k)
        valid = (torch.arange(k) < count) & (picks >= 0)
        out = torch.full((k,), -1, dtype=torch.int32)
        out[valid] = buffer_locs[picks[valid]].to(torch.int32)
        return RequestPlan(out, torch.ones(k, dtype=torch.bool), 0, 0, empty64, empty32, empty64, empty64, None)
    out = torch.full((k,), -1, dtype=torch.int32)
    written = torch.zeros(k, dtype=torch.bool)
    newest = picks == seq_len - 1
    out[newest] = int(buffer_locs[hot])
    written |= newest
    pending_idx = torch.nonzero((picks >= 0) & ~newest).flatten()  # pick indices still to resolve, in order
    lru_l = lru[:hot].to(torch.int64)
    held = buffer_tokens[lru_l].to(torch.int64)  # token per LRU position
    hit_pos = torch.zeros(hot, dtype=torch.bool)
    pick_hit = torch.zeros(k, dtype=torch.bool)
    if pending_idx.numel():
        vals = picks[pending_idx]
        order = torch.argsort(vals, stable=True)  # first occurrence of a duplicate comes first
        sorted_vals = vals[order]
        pos = torch.searchsorted(sorted_vals, held).clamp(max=sorted_vals.numel() - 1)
        hit_pos = (held >= 0) & (sorted_vals[pos] == held)
        hit_pick = pending_idx[order[pos[hit_pos]]]
        out[hit_pick] = buffer_locs[lru_l[hit_pos]].to(torch.int32)
        written[hit_pick] = True
        pick_hit[hit_pick] = True
    miss_idx = pending_idx[~pick_hit[pending_idx]]
    evictable = lru_l[~hit_pos]  # oldest first
    m = miss_idx.numel()
    if m > evictable.numel():
        raise ValueError(f"hot buffer of {hot} slots cannot take {m} misses next to {hot - evictable.numel()} hits")
    take = evictable[:m]
    out[miss_idx] = buffer_locs[take].to(torch.int32)
    written[miss_idx] = True
    miss_tokens = picks[miss_idx]
    new_lru = torch.cat([evictable[m:], take, lru_l[hit_pos]]).to(torch.int16)
    hits = int(newest.sum()) + int(pick_hit.sum())
    return RequestPlan(
        out,
        written,
        hits,
        m,
        host_locs[miss_tokens].to(torch.int64),
        buffer_locs[take].to(torch.int32),
        take,
        miss_tokens,
        new_lru,
    )


def load_cache_to_device_buffer_dsv4(
    top_k_tokens: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    num_top_k: int,
    hot_buffer_size: int,
    num_real_reqs: int | torch.Tensor | None = None,
) -> SwapInCounts:
    """sglang's `load_cache_to_device_buffer_dsv4_mla` for one c4 layer, in place.

    top_k_tokens: int32 [B, >=K] compressed positions; device_buffer_tokens / device_buffer_locs: int32
    [R, hot + page] (this layer); host_cache_locs: int64 [R, >= max L]; host_cache / device_buffer: uint8
    [pages, 37440]; top_k_device_locs: int32 [>=B, >=K] output; req_pool_indices: int [B]; seq_lens: int [B]
    compressed lengths; lru_slots: int16 [R, hot]. Rows b >= num_real_reqs (CUDA-graph padding) get -1.
    Mutates device_buffer_tokens, lru_slots, device_buffer and top_k_device_locs; returns the counters.
    """
    if hot_buffer_size < num_top_k:
        raise ValueError(f"hot_buffer_size {hot_buffer_size} must be >= num_top_k {num_top_k} (sglang requires it)")
    _check_cache("host_cache", host_cache)
    _check_cache("device_buffer", device_buffer)
    b_total = top_k_tokens.shape[0]
    real = b_total if num_real_reqs is None else int(num_real_reqs)
    k, hot = num_top_k, hot_buffer_size
    lookups = hits = misses = 0
    srcs, dsts = [], []
    for b in range(b_total):
        if b >= real:
            top_k_device_locs[b, :k] = -1
            continue
        rid, seq_len = int(req_pool_indices[b]), int(seq_lens[b])
        plan = plan_request(
            top_k_tokens[b].cpu(),
            seq_len,
            device_buffer_tokens[rid].cpu(),
            device_buffer_locs[rid].cpu(),
            host_cache_locs[rid].cpu(),
            lru_slots[rid].cpu(),
            hot,
            k,
        )
        row = top_k_device_locs[b, :k]
        w = plan.written.to(row.device)
        row[w] = plan.out_locs.to(row.device)[w]
        if plan.new_lru is None:
            continue
        lookups += int((top_k_tokens[b, :k] >= 0).sum())
        hits, misses = hits + plan.hits, misses + plan.misses
        device_buffer_tokens[rid, plan.loaded_slots.to(device_buffer_tokens.device)] = plan.loaded_tokens.to(
            device_buffer_tokens
        )
        lru_slots[rid, :hot] = plan.new_lru.to(lru_slots.device)
        srcs.append(plan.miss_src)
        dsts.append(plan.miss_dst)
    if srcs:
        copy_c4_tokens(host_cache, device_buffer, torch.cat(srcs), torch.cat(dsts))
    return SwapInCounts(lookups, hits, misses, misses * ITEM_BYTES)
