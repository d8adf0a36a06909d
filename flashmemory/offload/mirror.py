"""The host mirror: the full history of every live request, per layer, in page rows.

Pinned when CUDA is present (so recall can copy asynchronously), plain memory on CPU.
Mirror pages are handed to requests from a free list; a request's logical page p lives at
mirror page `mpages[p]`. Freed pages keep stale bytes, but the lookup table never points at them.
"""

from __future__ import annotations

import torch

from flashmemory.offload.layout import OffloadLayout


class OffloadCapacityError(RuntimeError):
    """A fixed-size offload structure (mirror pages, rows, per-request history) is full."""


def _host_empty(shape: tuple[int, ...], pin: bool) -> torch.Tensor:
    # Allocate pinned directly: pinning a pageable tensor afterwards would need twice the host RAM.
    return torch.zeros(shape, dtype=torch.uint8, pin_memory=pin)


class HostMirror:
    """kv: uint8 [n_layers, n_pages, kv_page_bytes]; index: uint8 [len(offload_index_layers), n_pages, index_page_bytes].

    index row i holds layer `layout.offload_index_layers[i]` (Path-I). Target layers' index-K stays on the
    device (`TargetIndexPool`), so it is not mirrored.
    """

    def __init__(self, layout: OffloadLayout, n_pages: int, pin: bool | None = None):
        if n_pages < 1:
            raise ValueError(f"HostMirror needs n_pages >= 1, got {n_pages}")
        self.layout = layout
        self.n_pages = n_pages
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        self.kv = _host_empty((layout.n_layers, n_pages, layout.kv_page_bytes), self.pinned)
        self.index = _host_empty((len(layout.offload_index_layers), n_pages, layout.index_page_bytes), self.pinned)
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OffloadCapacityError(f"host mirror: need {n} pages, {len(self._free)} of {self.n_pages} free "
                                       f"(raise EngineConfig.mirror_pages)")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def write(self, mchunks: torch.Tensor, kv: torch.Tensor, index: torch.Tensor | None) -> None:
        """Write chunk rows at mirror chunks (mirror_page * page_chunks + off).

        kv: [n_layers, n, kv_chunk_bytes] uint8; index: [n_layers, n, index_chunk_bytes] uint8 (all layers; only the
        Path-I layers are kept here) or None when Path-I is off.
        """
        pc = self.layout.page_chunks
        mchunks = mchunks.cpu().long()
        rows, offs = mchunks // pc, mchunks % pc
        self.layout.kv.write_chunks(self.kv, rows, offs, kv.cpu())
        ol = self.layout.offload_index_layers
        if ol and index is not None:
            self.layout.index.write_chunks(self.index, rows, offs, index.cpu()[list(ol)])
