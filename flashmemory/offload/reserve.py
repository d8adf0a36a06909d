"""Device-side storage: the reserve (recall blocks | decode regions | sink) and the target-layer index-K pool.

Cell space (one cell = one chunk; cell c is offset c % page_chunks of block c // page_chunks):

    blocks [0, R)                       recall blocks, one recalled page each, handed out by `BlockAllocator`
    blocks [R, R + max_rows * D)        decode regions: row r owns blocks R + r*D .. R + r*D + D - 1
    block  R + max_rows * D             the sink block; rows that are padding in a static batch write there
    blocks [sink + 1, sink + 1 + A)     landing blocks (A = landing_blocks, default 0): scratch cells a host
                                        driver may point a prefill store at before moving the bytes to the mirror

R = recall_blocks, D = decode_pages. The layout is fixed at construction, so every index the engine
produces is < n_blocks by construction, whatever the batch size.
"""

from __future__ import annotations

import torch

from flashmemory.offload import streams
from flashmemory.offload.layout import OffloadLayout


class DeviceReserve:
    """kv: uint8 [n_layers, n_blocks, kv_page_bytes];
    index: uint8 [len(offload_index_layers), n_blocks, index_page_bytes].

    Path-I index blocks use the same block ids as the c4 KV blocks.
    """

    def __init__(
        self,
        layout: OffloadLayout,
        recall_blocks: int,
        max_rows: int,
        decode_pages: int,
        device: torch.device | str = "cpu",
        landing_blocks: int = 0,
    ):
        if recall_blocks < 1 or max_rows < 1 or decode_pages < 1 or landing_blocks < 0:
            raise ValueError(
                f"DeviceReserve needs recall_blocks, max_rows, decode_pages >= 1 and landing_blocks >= 0, "
                f"got {recall_blocks}, {max_rows}, {decode_pages}, {landing_blocks}"
            )
        self.layout = layout
        self.recall_blocks = recall_blocks
        self.max_rows = max_rows
        self.decode_pages = decode_pages
        self.decode_base = recall_blocks
        self.sink_block = recall_blocks + max_rows * decode_pages
        self.landing_base = self.sink_block + 1
        self.landing_blocks = landing_blocks
        self.n_blocks = self.landing_base + landing_blocks
        self.sink_cell = self.sink_block * layout.page_chunks
        self.device = torch.device(device)
        self.kv = torch.zeros(
            layout.n_layers, self.n_blocks, layout.kv_page_bytes, dtype=torch.uint8, device=self.device
        )
        self.index = torch.zeros(
            len(layout.offload_index_layers),
            self.n_blocks,
            layout.index_page_bytes,
            dtype=torch.uint8,
            device=self.device,
        )

    def decode_block(self, row: int, slot: int) -> int:
        if not (0 <= row < self.max_rows and 0 <= slot < self.decode_pages):
            raise IndexError(
                f"decode block (row {row}, slot {slot}) outside {self.max_rows} rows x {self.decode_pages}"
            )
        return self.decode_base + row * self.decode_pages + slot

    def write_cells(self, cells: torch.Tensor, kv: torch.Tensor, index: torch.Tensor | None) -> None:
        """Write chunk rows into cells [n]. kv: [n_layers, n, kv_chunk_bytes]; index: [n_layers, n, idx_chunk_bytes]."""
        pc = self.layout.page_chunks
        cells = streams.like(cells, self.kv).long()
        self.layout.kv.write_chunks(self.kv, cells // pc, cells % pc, kv)
        ol = self.layout.offload_index_layers
        if ol and index is not None:
            self.layout.index.write_chunks(self.index, cells // pc, cells % pc, index[list(ol)])

    def copy_block(self, src: int, dst: int) -> None:
        """Device-local copy of a whole block (all layers, c4 KV and Path-I index)."""
        self.kv[:, dst].copy_(self.kv[:, src])
        if self.index.shape[0]:
            self.index[:, dst].copy_(self.index[:, src])


class BlockAllocator:
    """Free list of recall blocks [0, n)."""

    def __init__(self, n: int):
        self.n = n
        self._free = list(range(n - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._free)

    def pop(self) -> int | None:
        return self._free.pop() if self._free else None

    def push(self, block: int) -> None:
        if not 0 <= block < self.n:
            raise IndexError(f"block {block} is not a recall block (0..{self.n - 1})")
        self._free.append(block)

    def free_blocks(self) -> list[int]:
        """A copy of the free list (invariant checks)."""
        return list(self._free)


class TargetIndexPool:
    """Full index-K of the target layers on the device, by mirror page: `pages[t]` is uint8 [n_pages,
    index_page_bytes] for target layer `layers[t]`.

    Level 1 scores it and Level 2 reads it for target layers; it is never offloaded. `buffers` (one per target
    layer) makes it a view of storage the caller already keeps up to date, such as sglang's own index-K pool
    when mirror pages are pool pages; `write` then still writes through.
    """

    def __init__(
        self,
        layout: OffloadLayout,
        n_pages: int,
        device: torch.device | str = "cpu",
        buffers: list[torch.Tensor] | None = None,
    ):
        self.layout = layout
        self.layers = tuple(layout.target_layers)
        if buffers is None:
            self.pages: torch.Tensor | list[torch.Tensor] = torch.zeros(
                len(self.layers), n_pages, layout.index_page_bytes, dtype=torch.uint8, device=device
            )
            return
        want = (n_pages, layout.index_page_bytes)
        if len(buffers) != len(self.layers) or any(b.dtype != torch.uint8 or tuple(b.shape) != want for b in buffers):
            raise ValueError(
                f"TargetIndexPool: expected {len(self.layers)} uint8 {want} buffers, got "
                f"{[(b.dtype, tuple(b.shape)) for b in buffers]}"
            )
        self.pages = list(buffers)

    def write(self, mchunks: torch.Tensor, index: torch.Tensor) -> None:
        """index: [n_layers, n, idx_chunk_bytes] for all layers; only target layers are kept."""
        pc = self.layout.page_chunks
        for t, l in enumerate(self.layers):
            m = streams.like(mchunks, self.pages[t]).long()
            self.layout.index.write_chunks(self.pages[t], m // pc, m % pc, index[l])

    def chunks(self, layer: int, mchunks: torch.Tensor) -> torch.Tensor:
        """Chunk rows [n, D+4] uint8 of target layer `layer` at mirror chunks [n]."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not a target layer {self.layers}")
        pc = self.layout.page_chunks
        buf = self.pages[self.layers.index(layer)]
        m = streams.like(mchunks, buf).long()
        return self.layout.index.read_chunks(buf, m // pc, m % pc)
