"""What one disk page holds: page `p` of every offloaded row of the host mirror, all layers, in one slot.

Payload = the c4 KV page rows of all `n_layers` ([n_layers, kv_page_bytes], 37,440 B each on DeepSeek-V4-Flash),
then the Path-I index-K page rows of the offloaded layers ([len(offload_index_layers), index_page_bytes],
8,448 B each): 21 x 37,440 + 18 x 8,448 = 938,304 B per page with Path-I, 786,240 B without. One page is the
unit Level 1 recalls, so a recall reads whole slots.
"""

from __future__ import annotations

import torch

from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.mirror import HostMirror


def disk_page_bytes(layout: OffloadLayout) -> int:
    return layout.n_layers * layout.kv_page_bytes + len(layout.offload_index_layers) * layout.index_page_bytes


def pack_rows(kv: torch.Tensor, index: torch.Tensor) -> bytearray:
    """One payload from a page's rows: kv uint8 [n_layers, kv_page_bytes], index uint8 [len(offload_index_layers),
    index_page_bytes] (may have 0 rows). The layout `pack_page` writes and `unpack_page` reads."""
    parts = [kv.contiguous().reshape(-1).numpy().tobytes()]
    if index.shape[0]:
        parts.append(index.contiguous().reshape(-1).numpy().tobytes())
    return bytearray(b"".join(parts))


def pack_page(mirror: HostMirror, mpage: int) -> bytearray:
    """Mirror page `mpage` (all layers, KV then Path-I index-K) as one payload of disk_page_bytes(layout) bytes.
    Raises ReleasedPageError when the page has no DRAM slot (landing window)."""
    s = mirror.row(mpage)
    return pack_rows(mirror.kv[:, s], mirror.index[:, s])


def unpack_rows(data: bytes | bytearray | memoryview, layout: OffloadLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """A payload from `pack_rows` as (kv uint8 [n_layers, kv_page_bytes], index uint8 [len(offload_index_layers),
    index_page_bytes]), a fresh copy. ValueError when the size is not disk_page_bytes(layout)."""
    need = disk_page_bytes(layout)
    mv = memoryview(data).cast("B")
    if mv.nbytes != need:
        raise ValueError(f"unpack_page: {mv.nbytes} B for a {need}-B disk page")
    flat = torch.frombuffer(bytearray(mv), dtype=torch.uint8)
    nkv = layout.n_layers * layout.kv_page_bytes
    return (
        flat[:nkv].view(layout.n_layers, layout.kv_page_bytes),
        flat[nkv:].view(len(layout.offload_index_layers), layout.index_page_bytes),
    )


def unpack_page(data: bytes | bytearray | memoryview, mirror: HostMirror, mpage: int) -> None:
    """Write a payload from `pack_page` back into mirror page `mpage` (in place; a window gives it a slot)."""
    kv, ix = unpack_rows(data, mirror.layout)
    s = mirror.row(mpage, write=True)
    mirror.kv[:, s] = kv
    if mirror.index.shape[0]:
        mirror.index[:, s] = ix


def pages_from_chunks(layout: OffloadLayout, kv: torch.Tensor, index: torch.Tensor | None) -> list[bytearray]:
    """Payloads of whole pages built straight from chunk rows (the landing window puts an admission's complete
    pages into the tier without a mirror slot). kv: uint8 [n_layers, k * page_chunks, kv_chunk_bytes]; index:
    uint8 [n_layers, k * page_chunks, index_chunk_bytes] (all layers) or None when Path-I is off. Bytes a page
    row pads with are 0, as in a mirror page that was never written there."""
    pc, ol = layout.page_chunks, list(layout.offload_index_layers)
    k = kv.shape[1] // pc
    j = torch.arange(k * pc)
    kvp = torch.zeros((layout.n_layers, k, layout.kv_page_bytes), dtype=torch.uint8)
    layout.kv.write_chunks(kvp, j // pc, j % pc, kv.cpu())
    ixp = torch.zeros((len(ol), k, layout.index_page_bytes), dtype=torch.uint8)
    if ol:
        if index is None:
            raise ValueError("pages_from_chunks: Path-I is on but no index-K chunk rows were given")
        layout.index.write_chunks(ixp, j // pc, j % pc, index.cpu()[ol])
    return [pack_rows(kvp[:, i], ixp[:, i]) for i in range(k)]
