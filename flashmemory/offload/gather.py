"""Batched page copies between host and device tensors of page rows: one gather and one indexed copy per call.

Used by the recaller (mirror -> reserve), the disk tier (staged pages -> reserve) and `bench recall`.
"""

from __future__ import annotations

import torch

from flashmemory.offload import streams


def wide(t: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed with the widest integer dtype dividing the row: indexed copies move whole words."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[-1] % size == 0:
            return t.view(dt)
    return t


def gather_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    stage: torch.Tensor | None = None,
) -> torch.Tensor:
    """dst[:, dst_idx] = src[:, src_idx] with one gather and one copy. src: [L, P, W] host; dst: [L, NB, W].

    stage: optional reusable buffer with at least L*K*W bytes (pinned for an async H2D copy; a new one is pinned
    when dst is on a stream device). Returns the staging tensor [L, K, W], which must live until the copy
    completes (the pinned allocator keeps a dropped one until then).
    """
    shape = (src.shape[0], src_idx.numel(), src.shape[2])
    n = shape[0] * shape[1] * shape[2]
    if stage is None or stage.numel() < n:
        pin = streams.is_device(dst) and streams.streams_on(dst.device)
        stage = streams.pinned_empty((n,), src.dtype) if pin else torch.empty(n, dtype=src.dtype)
    stage = stage[:n].view(shape)
    torch.index_select(src, 1, src_idx, out=stage)
    dev_idx = streams.like(dst_idx, dst)
    wide(dst).index_copy_(1, dev_idx, wide(stage.to(dst.device, non_blocking=stage.is_pinned())))
    return stage


def page_by_page_copy(src: torch.Tensor, dst: torch.Tensor, src_idx: list[int], dst_idx: list[int]) -> None:
    """The baseline `gather_copy` is measured against: one copy per (layer, page)."""
    for layer in range(src.shape[0]):
        for s, d in zip(src_idx, dst_idx):
            dst[layer, d].copy_(src[layer, s])


def keep_staging(cache: dict[str, torch.Tensor], key: str, stage: torch.Tensor) -> None:
    """Keep `stage` (flat) as the reusable staging buffer under `key` when it is larger than the one held."""
    if key not in cache or stage.numel() > cache[key].numel():
        cache[key] = stage.view(-1)
