"""`HostMirror` with a landing window: page ids keep their meaning, the tensors hold `slots` rows.

- slot accounting: `alloc` hands out ids without slots, the first write gives a page a slot, `claim` takes them at
  once (all or none), `release` gives slots back (the tier holds the bytes), `free` gives back ids and slots;
  out of slots is an `OffloadCapacityError` naming SGLANG_PATHP_HOST_MIRROR_GB;
- translation: the bytes written at page ids are read back at the same ids, through whatever slot each got;
- a released (or never written) page raises on read, never returns another page's bytes;
- `slots=None` is today's mirror: no table, `rows` returns the ids, the same bytes as a full-size write.
"""

from __future__ import annotations

import pytest
import torch

from flashmemory.offload import HostMirror, OffloadCapacityError, OffloadLayout
from flashmemory.offload.disk import pack_page, unpack_page
from flashmemory.offload.mirror import FRESH, RELEASED, ReleasedPageError

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
PC = LAYOUT.page_chunks


def page_rows(page: int, n: int = PC, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mirror chunks of `n` chunks of `page` and random kv / index chunk rows for them."""
    g = torch.Generator().manual_seed(1000 * page + seed)
    m = page * PC + torch.arange(n)
    kv = torch.randint(0, 256, (LAYOUT.n_layers, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = torch.randint(0, 256, (LAYOUT.n_layers, n, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g)
    return m, kv, ix


def read_page(mirror: HostMirror, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = mirror.row(page)
    return mirror.kv[:, s].clone(), mirror.index[:, s].clone()


def test_slot_accounting() -> None:
    mir = HostMirror(LAYOUT, n_pages=10, pin=False, slots=3)
    assert mir.kv.shape[1] == 3 and mir.index.shape[1] == 3 and mir.n_pages == 10
    assert mir.physical_bytes == 3 * mir.page_bytes == mir.kv.nbytes + mir.index.nbytes
    a = mir.alloc(5)  # ids only: no slot is taken before a page's first bytes
    assert a == [0, 1, 2, 3, 4] and mir.free_pages == 5 and mir.slots_in_use == 0 and mir.free_slots == 3
    assert (mir.slot_of[a] == FRESH).all()
    for p in a[:3]:
        mir.write(*page_rows(p))
    assert mir.slots_in_use == 3 and mir.free_slots == 0 and mir.peak_slots == 3
    assert sorted(mir.slot_of[a[:3]].tolist()) == [0, 1, 2]
    with pytest.raises(OffloadCapacityError, match="SGLANG_PATHP_HOST_MIRROR_GB") as e:
        mir.write(*page_rows(a[3]))
    assert "\n" not in str(e.value)
    assert mir.release([a[0], a[1]]) == 2 and mir.free_slots == 2
    assert mir.slot_of[a[0]] == RELEASED and mir.free_pages == 5  # the ids stay with their request
    mir.write(*page_rows(a[3]))
    mir.write(*page_rows(a[4]))
    assert mir.slots_in_use == 3
    with pytest.raises(OffloadCapacityError, match="need 2 page slots, 0 of 3 free"):
        mir.claim([7, 8])  # all or none: neither id was taken
    assert mir.free_pages == 5 and 7 in mir._free_set and 8 in mir._free_set
    mir.free(a)  # ids and slots back, released or not
    assert mir.free_pages == 10 and mir.free_slots == 3 and (mir.slot_of == FRESH).all()
    got = mir.claim([7, 8])  # a claim's bytes arrive from outside: slots at once
    assert got == [7, 8] and mir.slots_in_use == 2 and (mir.slot_of[[7, 8]] >= 0).all()
    with pytest.raises(RuntimeError, match="no request owns"):
        mir.release([0])
    mir.free([7, 8])
    assert mir.slots_in_use == 0 and mir.peak_slots == 3
    with pytest.raises(ValueError, match="slots must lie in"):
        HostMirror(LAYOUT, n_pages=4, pin=False, slots=5)


def test_translation_keeps_every_page_bytes_and_a_released_page_raises() -> None:
    mir = HostMirror(LAYOUT, n_pages=12, pin=False, slots=4)
    want = {}
    pages = mir.alloc(12)
    for k, p in enumerate(pages):
        m, kv, ix = page_rows(p)
        mir.write(m, kv, ix)
        ref = HostMirror(LAYOUT, n_pages=12, pin=False)  # the page as a full-size mirror holds it
        ref.write(m, kv, ix)
        want[p] = read_page(ref, p)
        if k % 2 == 1:  # keep two pages in DRAM at most, as a seal would: release the older of each pair
            assert torch.equal(read_page(mir, pages[k - 1])[0], want[pages[k - 1]][0])
            mir.release([pages[k - 1]])
        blob = pack_page(mir, p)  # the tier's packing reads through the translation too
        assert torch.equal(read_page(mir, p)[0], want[p][0]) and torch.equal(read_page(mir, p)[1], want[p][1])
        back = HostMirror(LAYOUT, n_pages=12, pin=False, slots=2)
        back.alloc(12)
        unpack_page(blob, back, p)  # unpacking into a window page gives it a slot
        assert torch.equal(read_page(back, p)[0], want[p][0]) and torch.equal(read_page(back, p)[1], want[p][1])
        if k % 2 == 1:
            mir.release([p])
    assert mir.peak_slots <= 2 and mir.slots_in_use == 0
    for p in pages:  # every page is released now: reading any of them is a bug
        with pytest.raises(ReleasedPageError, match=f"page {p} was released to the disk tier"):
            read_page(mir, p)
        with pytest.raises(ReleasedPageError):
            pack_page(mir, p)
    with pytest.raises(ReleasedPageError, match="write"):  # a released page is never written again either
        mir.write(*page_rows(pages[0]))
    fresh = HostMirror(LAYOUT, n_pages=3, pin=False, slots=2)
    fresh.alloc(1)
    with pytest.raises(ReleasedPageError, match="holds no bytes yet"):
        fresh.row(0)


def test_partial_pages_and_chunk_writes_land_in_their_page() -> None:
    """Chunk writes spread over several pages in one call (decode rounds do that) land in each page's slot."""
    mir, ref = HostMirror(LAYOUT, n_pages=6, pin=False, slots=3), HostMirror(LAYOUT, n_pages=6, pin=False)
    mir.alloc(6), ref.alloc(6)
    for seed, chunks in enumerate(([5 * PC + 1, 2 * PC, 5 * PC + 3], [2 * PC + 2, 4 * PC], [4 * PC + 1, 2 * PC + 3])):
        m = torch.tensor(chunks)
        _, kv, ix = page_rows(0, len(chunks), seed)
        mir.write(m, kv, ix)
        ref.write(m, kv, ix)
    assert mir.slots_in_use == 3
    for p in (2, 4, 5):
        got, exp = read_page(mir, p), read_page(ref, p)
        assert torch.equal(got[0], exp[0]) and torch.equal(got[1], exp[1]), p


def test_slots_none_is_the_full_size_mirror() -> None:
    mir, win = HostMirror(LAYOUT, n_pages=5, pin=False), HostMirror(LAYOUT, n_pages=5, pin=False, slots=5)
    assert mir.slot_of is None and mir.kv.shape[1] == 5 and mir.n_slots == 5
    ids = torch.tensor([4, 0, 3])
    assert mir.rows(ids) is ids  # no translation at all: the ids are the rows
    assert mir.release([0, 1]) == 0  # nothing to release on a full-size mirror
    assert mir.alloc(5) == win.alloc(5) == [0, 1, 2, 3, 4]
    assert mir.slots_in_use == 5 and mir.free_slots == 0  # slots = pages in use
    for p in (3, 0, 4):
        m, kv, ix = page_rows(p, 3)
        mir.write(m, kv, ix)
        win.write(m, kv, ix)
        assert torch.equal(mir.kv[:, p], read_page(win, p)[0]) and torch.equal(mir.index[:, p], read_page(win, p)[1])
        assert bytes(pack_page(mir, p)) == bytes(pack_page(win, p))
    mir.free([0, 3])
    assert mir.free_pages == 2 and mir.slots_in_use == 3
