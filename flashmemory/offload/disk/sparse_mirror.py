"""A host mirror addressed by page id whose DRAM follows the pages it holds (shrink mode under the disk tier).

Shrink mode's mirror is where the PD transfer engine lands prefill's c4 KV: the engine writes page p of layer l
at `kv[l].data_ptr() + p * kv_page_bytes`, so the buffer must span every page id of sglang's c4 pool. Here it is
one anonymous mapping per tensor made with MAP_NORESERVE: the kernel backs a 4 KiB OS page with DRAM at its first
write, so an untouched page id costs address space only. The tier then takes what the mirror held:

  land      the transfer (or a decode settle) writes a page: its OS pages become resident.
  seal      the tier holds the page's bytes (`TieredEngine.seal_admitted`, `seal`), so `release` hands its whole
            OS pages back (madvise MADV_DONTNEED: the next read of them is zeros, never another page's bytes) and
            marks the page RELEASED: `rows` raises on it from then on, as in the landing window.

Invariants: slot == page id (`slot_of[p]` is p while the page holds bytes, FRESH or RELEASED otherwise), so the
address the transfer engine computes is the one every reader translates to. An OS page shared by two mirror
pages (kv_page_bytes is not a multiple of 4 KiB) is returned only when every mirror page on it is released,
never while a neighbour holds bytes, is free (a transfer may be landing there) or is still being decoded; so a
released page next to such a neighbour keeps up to one OS page per side and layer until the neighbour is
released too. DRAM held ~ (landed, not yet sealed pages + each live request's open tail page) x page bytes.

Parked pages (`park` / `unpark`): a free page id holding the bytes of a request whose transfer is done but that
is not running yet (sglang's decode waiting queue) can be parked once the tier holds its bytes: its OS pages go
back as a released page's do (shared OS pages likewise only when every page on them is released or parked), and
`unpark` writes the tier's bytes back at the same address before the request is admitted. A parked page stays
free in the mirror's bookkeeping (the admission claims it as usual).

Where the transfer backend pins the registered buffer (RDMA registration without on-demand paging) the whole
mapping becomes resident at registration; on CPU (NIXL over TCP / shared memory) it does not. Never pinned, so
recall reads the few unsealed pages from pageable memory.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.mirror import FRESH, RELEASED, HostMirror

OS_PAGE = mmap.PAGESIZE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _sparse_zeros(shape: tuple[int, ...]) -> tuple[torch.Tensor, mmap.mmap | None]:
    """uint8 tensor of `shape` over a fresh anonymous MAP_NORESERVE mapping (reads as zeros, no DRAM until
    written) and the mapping (kept alive by the caller); an empty shape gets a plain tensor and None."""
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.zeros(shape, dtype=torch.uint8), None
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    return torch.frombuffer(mm, dtype=torch.uint8).view(shape), mm


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s storage backed by DRAM now (mincore over its OS pages; Linux). -1 where it cannot be told."""
    n = t.numel() * t.element_size()
    if n == 0:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return -1
    start = t.data_ptr() - t.data_ptr() % OS_PAGE
    length = t.data_ptr() + n - start
    vec = (ctypes.c_ubyte * -(-length // OS_PAGE))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return -1
    return sum(b & 1 for b in vec) * OS_PAGE


class SparseMirror(HostMirror):
    """`HostMirror` of `n_pages` page ids at their pool addresses, backed by DRAM only where it holds bytes (see
    the module doc). kv: uint8 [n_layers, n_pages, kv_page_bytes]; index: uint8 [len(offload_index_layers),
    n_pages, index_page_bytes]. Page ids, `claim`, `alloc`, `free`, `rows` behave as `HostMirror`'s."""

    def __init__(self, layout: OffloadLayout, n_pages: int):
        if n_pages < 1:
            raise ValueError(f"SparseMirror needs n_pages >= 1, got {n_pages}")
        self.layout, self.n_pages, self.n_slots, self.pinned = layout, n_pages, n_pages, False
        self.kv, self._kv_map = _sparse_zeros((layout.n_layers, n_pages, layout.kv_page_bytes))
        self.index, self._ix_map = _sparse_zeros((len(layout.offload_index_layers), n_pages, layout.index_page_bytes))
        self._free = list(range(n_pages - 1, -1, -1))
        self._free_set = set(self._free)
        self.slot_of = torch.full((n_pages,), FRESH, dtype=torch.int64)
        self._free_slots: list[int] = []
        self.peak_slots = 0
        self.dropped_bytes = 0  # OS-page bytes handed back by `release` and `park` (running total)
        self.parked: set[int] = set()  # free page ids whose bytes the tier holds (see `park`)

    @property
    def free_slots(self) -> int:
        return self.n_pages - int((self.slot_of >= 0).sum())

    @property
    def physical_bytes(self) -> int:
        """Host bytes the mirror's pages with bytes take (pages holding bytes x page bytes), not the mapping."""
        return self.slots_in_use * self.page_bytes

    @property
    def allocated_bytes(self) -> int:
        return self.physical_bytes

    def _take_slots(self, pages: list[int]) -> None:
        """A page's slot is its id: the transfer engine already wrote (or will write) it there."""
        for p in pages:
            self.slot_of[p] = p
        self.peak_slots = max(self.peak_slots, self.slots_in_use)

    def release(self, pages: list[int]) -> int:
        """The tier holds these owned pages: mark them RELEASED (reads raise) and hand their OS pages back.
        Returns the pages that held bytes."""
        held = [p for p in pages if int(self.slot_of[p]) >= 0] if pages else []
        super().release(pages)  # validates ownership before any memory is touched
        self._free_slots.clear()
        self._drop(sorted(set(pages)))
        return len(held)

    def free(self, pages: list[int]) -> None:
        """As `HostMirror.free`; the bytes stay (a freed pool page may be landing the next request's KV already)."""
        super().free(pages)
        self._free_slots.clear()

    def park(self, pages: list[int]) -> None:
        """The tier holds the bytes of these free page ids (a queued request's landed pages): hand their OS pages
        back (`_drop`'s rule). ValueError when a page is claimed (a running request's): nothing changes then."""
        busy = [p for p in pages if p not in self._free_set]
        if busy:
            raise ValueError(f"SparseMirror.park: pages {busy[:8]} are claimed, not free")
        self.parked.update(pages)
        self._drop(sorted(set(pages)))

    def unpark(self, page: int, kv: torch.Tensor, index: torch.Tensor) -> None:
        """Write a parked page's bytes back at its address (kv uint8 [n_layers, kv_page_bytes], index uint8
        [len(offload_index_layers), index_page_bytes]); it holds bytes in DRAM again and is no longer parked."""
        if page not in self.parked:
            raise ValueError(f"SparseMirror.unpark: page {page} is not parked")
        self.kv[:, page] = kv
        if self.index.shape[0]:
            self.index[:, page] = index
        self.parked.discard(page)

    def forget_parked(self, pages: list[int]) -> None:
        """These pages are no longer parked (their request left without running: the bytes are not needed)."""
        self.parked.difference_update(pages)

    def _gone(self, page: int) -> bool:
        """Its bytes are the tier's (released, or parked and still free): its OS pages may go back."""
        return int(self.slot_of[page]) == RELEASED or (page in self.parked and page in self._free_set)

    def _drop(self, pages: list[int]) -> None:
        """madvise(MADV_DONTNEED) every OS page of these (released or parked) pages, in every layer, whose bytes all
        belong to released or parked pages: an OS page shared with a page that holds bytes, is free or is landing
        stays."""
        for t, mm in ((self.kv, self._kv_map), (self.index, self._ix_map)):
            if mm is None:
                continue
            width, n = t.shape[2], self.n_pages
            total = t.shape[0] * n * width
            drop: set[int] = set()
            for layer in range(t.shape[0]):
                for p in pages:
                    lo, hi = (layer * n + p) * width, (layer * n + p + 1) * width
                    drop.update(range(lo // OS_PAGE, -(-hi // OS_PAGE)))
            for o in sorted(drop):
                a, b = o * OS_PAGE, min((o + 1) * OS_PAGE, total)
                if all(self._gone(g % n) for g in range(a // width, -(-b // width))):
                    mm.madvise(mmap.MADV_DONTNEED, a, b - a)
                    self.dropped_bytes += b - a
