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


def pack_page(mirror: HostMirror, mpage: int) -> bytearray:
    """Mirror page `mpage` (all layers, KV then Path-I index-K) as one payload of disk_page_bytes(layout) bytes."""
    kv = mirror.kv[:, mpage].contiguous().reshape(-1)
    parts = [kv.numpy().tobytes()]
    if mirror.index.shape[0]:
        parts.append(mirror.index[:, mpage].contiguous().reshape(-1).numpy().tobytes())
    return bytearray(b"".join(parts))


def unpack_page(data: bytes | bytearray | memoryview, mirror: HostMirror, mpage: int) -> None:
    """Write a payload from `pack_page` back into mirror page `mpage` (in place)."""
    lay = mirror.layout
    need = disk_page_bytes(lay)
    mv = memoryview(data).cast("B")
    if mv.nbytes != need:
        raise ValueError(f"unpack_page: {mv.nbytes} B for a {need}-B disk page")
    flat = torch.frombuffer(bytearray(mv), dtype=torch.uint8)
    nkv = lay.n_layers * lay.kv_page_bytes
    mirror.kv[:, mpage] = flat[:nkv].view(lay.n_layers, lay.kv_page_bytes)
    if mirror.index.shape[0]:
        mirror.index[:, mpage] = flat[nkv:].view(mirror.index.shape[0], lay.index_page_bytes)
