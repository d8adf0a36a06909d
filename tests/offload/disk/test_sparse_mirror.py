"""`SparseMirror`: a mirror addressed by page id whose DRAM (mincore) follows the pages holding bytes.

Untouched page ids cost no DRAM; `release` returns a page's OS pages, and an OS page shared with a neighbour is
returned only once that neighbour is released too (never while it holds bytes or is free: a transfer may be
landing there), so no byte of another page is ever zeroed."""

from __future__ import annotations

import pytest
import torch

from flashmemory.offload import OffloadLayout
from flashmemory.offload.disk.sparse_mirror import OS_PAGE, SparseMirror, resident_bytes
from flashmemory.offload.mirror import HostMirror, ReleasedPageError

LAYOUT = OffloadLayout(n_layers=2, target_layers=(1,))  # 37,376-B pages: not a multiple of 4 KiB


def fill(m: SparseMirror, pages: list[int], seed: int) -> dict[int, torch.Tensor]:
    g, out = torch.Generator().manual_seed(seed), {}
    for p in pages:
        out[p] = torch.randint(1, 256, (m.kv.shape[0], m.kv.shape[2]), dtype=torch.uint8, generator=g)
        m.kv[:, m.row(p, write=True)] = out[p]
    return out


def test_the_sparse_mirror_has_every_field_of_the_host_mirror() -> None:
    assert set(vars(HostMirror(LAYOUT, 4, pin=False, slots=2))) <= set(vars(SparseMirror(LAYOUT, 4)))


def test_dram_follows_the_pages_that_hold_bytes() -> None:
    n = 64
    m = SparseMirror(LAYOUT, n)
    width = LAYOUT.kv_page_bytes
    assert width % OS_PAGE != 0 and resident_bytes(m.kv) == 0  # a mapping, no DRAM yet
    pages = m.claim([10, 11, 12, 13, 30])
    truth = fill(m, pages, 0)
    landed = resident_bytes(m.kv)
    assert landed >= len(pages) * LAYOUT.n_layers * width
    assert m.row(12) == 12 and m.slots_in_use == 5  # slot == page id (the transfer's address)
    m.release([11, 12])
    for p in (10, 13, 30):  # neighbours keep every byte
        assert torch.equal(m.kv[:, p], truth[p]), p
    with pytest.raises(ReleasedPageError):
        m.row(11)
    mid = resident_bytes(m.kv)
    assert landed - mid >= 2 * LAYOUT.n_layers * (width - 2 * OS_PAGE)  # the interiors and the shared edge went
    m.release([10, 13, 30])
    assert resident_bytes(m.kv) <= 2 * LAYOUT.n_layers * 2 * OS_PAGE  # edges shared with free pages stay
    assert m.dropped_bytes > 0 and m.slots_in_use == 0
    m.free(pages)
    assert m.free_pages == n and m.free_slots == n
