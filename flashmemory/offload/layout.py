"""Byte layouts of the paged c4 KV and index-K rows, and the offload geometry.

A page holds `page_chunks` chunks. A chunk is a tuple of segments (c4 KV: 576 B nope+rope, then
8 B = 7 scales + 1 pad; index-K: D fp8 bytes, then a 4-byte fp32 scale). sglang stores a page
segment-major: segment s of chunk `off` sits at `page_chunks * sum(widths[:s]) + off * widths[s]`,
and the row is padded up to a multiple of `align`. A "chunk row" is the concatenation of the
chunk's segments ([584] for KV, [D+4] for index-K, the `flashmemory.retriever.fp8` chunk format).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from flashmemory.offload import streams


@dataclass(frozen=True)
class PageFormat:
    """One paged row format. widths: bytes of each chunk segment; align: the row is padded to a multiple of it."""

    widths: tuple[int, ...]
    page_chunks: int = 64
    align: int = 1

    def __post_init__(self) -> None:
        if not self.widths or min(self.widths) < 1:
            raise ValueError(f"PageFormat.widths must be positive segment sizes, got {self.widths}")
        if self.page_chunks < 1 or self.align < 1:
            raise ValueError(f"PageFormat needs page_chunks >= 1 and align >= 1, got {self.page_chunks}, {self.align}")

    @property
    def chunk_bytes(self) -> int:
        return sum(self.widths)

    @property
    def page_bytes(self) -> int:
        """Row width: ceil(page_chunks * chunk_bytes / align) * align."""
        return math.ceil(self.page_chunks * self.chunk_bytes / self.align) * self.align

    @cached_property
    def byte_map(self) -> torch.Tensor:
        """Int64 [page_chunks, chunk_bytes]: byte offset inside a page row of each byte of each chunk row."""
        off = torch.arange(self.page_chunks).unsqueeze(1)
        parts, base = [], 0
        for w in self.widths:
            parts.append(base + off * w + torch.arange(w).unsqueeze(0))
            base += self.page_chunks * w
        return torch.cat(parts, dim=1)

    @cached_property
    def _device_maps(self) -> dict[str, torch.Tensor]:
        return {}

    def byte_map_like(self, t: torch.Tensor) -> torch.Tensor:
        """`byte_map` where `t` lives; on a device it is computed there once (kernels, no host copy) and kept."""
        if not streams.is_device(t):
            return self.byte_map
        key = str(t.device)
        if key not in self._device_maps:
            off = torch.arange(self.page_chunks, device=t.device).unsqueeze(1)
            parts, base = [], 0
            for w in self.widths:
                parts.append(base + off * w + torch.arange(w, device=t.device).unsqueeze(0))
                base += self.page_chunks * w
            self._device_maps[key] = torch.cat(parts, dim=1)
        return self._device_maps[key]

    def flat_index(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Int64 [n, chunk_bytes] flat byte index into a contiguous [P, page_bytes] tensor for chunks
        (rows[n], offs[n])."""
        bm = self.byte_map_like(rows)
        return rows.long().unsqueeze(1) * self.page_bytes + bm[offs.long()]

    def read_chunks(self, pages: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """pages: [..., P, page_bytes] uint8 contiguous -> chunk rows [..., n, chunk_bytes] at (rows[n], offs[n])."""
        lead = pages.shape[:-2]
        flat = pages.reshape(*lead, -1)
        idx = self.flat_index(streams.like(rows, pages), streams.like(offs, pages))
        return flat[..., idx.reshape(-1)].reshape(*lead, idx.shape[0], self.chunk_bytes)

    def write_chunks(self, pages: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor, chunks: torch.Tensor) -> None:
        """Scatter chunk rows [..., n, chunk_bytes] into pages [..., P, page_bytes] (in place) at (rows[n], offs[n])."""
        if chunks.shape[-1] != self.chunk_bytes or chunks.shape[-2] != rows.shape[0]:
            raise ValueError(f"chunks {tuple(chunks.shape)} do not match {rows.shape[0]} rows of {self.chunk_bytes} B")
        if not pages.is_contiguous():
            raise ValueError("write_chunks needs contiguous pages")
        lead = pages.shape[:-2]
        flat = pages.view(*lead, -1)
        idx = self.flat_index(streams.like(rows, pages), streams.like(offs, pages)).reshape(-1)
        flat[..., idx] = streams.like(chunks, pages).to(torch.uint8).reshape(*lead, -1)


@dataclass(frozen=True)
class OffloadLayout:
    """Offload geometry. Defaults are DeepSeek-V4-Flash: 21 c4 layers, 64-chunk pages, 584-B KV entries
    (37,440-B page rows), 128-dim fp8 index keys (8,448-B pages), target layers 10, 12, 20.

    index_offload (Path-I): the index-K of the non-target layers lives in the mirror and the reserve too.
    """

    n_layers: int = 21
    page_chunks: int = 64
    kv_widths: tuple[int, ...] = (576, 8)  # 448 fp8 nope + 128 bf16 rope | 7 ue8m0 scales + 1 pad
    kv_align: int = 576
    index_head_dim: int = 128
    target_layers: tuple[int, ...] = (10, 12, 20)
    index_offload: bool = True

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"OffloadLayout.n_layers must be >= 1, got {self.n_layers}")
        bad = [t for t in self.target_layers if not 0 <= t < self.n_layers]
        if bad or not self.target_layers:
            raise ValueError(
                f"OffloadLayout.target_layers {self.target_layers} must be non-empty ids in [0, {self.n_layers})"
            )
        if self.index_head_dim < 1:
            raise ValueError("OffloadLayout.index_head_dim must be >= 1")

    @classmethod
    def tiny(cls, n_layers: int = 3, page_chunks: int = 4, target_layers: tuple[int, ...] = (1,)) -> "OffloadLayout":
        """A few-byte layout for tests: 8-B KV chunks, 4-dim index keys, same structure as the real one."""
        return cls(
            n_layers=n_layers,
            page_chunks=page_chunks,
            kv_widths=(6, 2),
            kv_align=4,
            index_head_dim=4,
            target_layers=target_layers,
        )

    @cached_property
    def kv(self) -> PageFormat:
        return PageFormat(self.kv_widths, self.page_chunks, self.kv_align)

    @cached_property
    def index(self) -> PageFormat:
        return PageFormat((self.index_head_dim, 4), self.page_chunks, 1)

    @property
    def kv_page_bytes(self) -> int:
        return self.kv.page_bytes

    @property
    def index_page_bytes(self) -> int:
        return self.index.page_bytes

    @property
    def offload_index_layers(self) -> tuple[int, ...]:
        """Layers whose index-K is offloaded (Path-I): every non-target layer, or none when Path-I is off."""
        if not self.index_offload:
            return ()
        return tuple(i for i in range(self.n_layers) if i not in self.target_layers)

    def pages_for(self, n_chunks: int) -> int:
        return -(-n_chunks // self.page_chunks)
