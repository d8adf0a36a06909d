"""The host mirror: the full history of every live request, per layer, in page rows.

Pinned when CUDA is present (so recall can copy asynchronously), plain memory on CPU.
Mirror pages are handed to requests from a free list (`alloc`), or claimed by id (`claim`) when the caller
owns the page numbering (sglang's c4 pool pages, so PD transfers can land in the mirror directly); a
request's logical page p lives at mirror page `mpages[p]`. Freed pages keep stale bytes, but the lookup table
never points at them.

Landing window (`slots` < n_pages, only under the disk tier): page ids stay as they are (the lookup
table, row page tables and recall plans key on them) but the tensors hold `slots` rows, and `slot_of[page]`
says which row holds a page (`FRESH` = no bytes yet, `RELEASED` = the disk tier holds its bytes now). A page
takes a slot when its first bytes are written (`rows(..., write=True)`; `claim` takes them at once, since the
bytes arrive from outside), and gives it back at `release` (the tier holds the page) or `free`. Every reader
and writer translates page ids with `rows`; reading a page without a slot raises `ReleasedPageError` instead of
returning another page's bytes. With `slots=None` there is no table: `rows` returns the ids (slot == page id).
"""

from __future__ import annotations

import torch

from flashmemory.offload.layout import OffloadLayout

FRESH, RELEASED = -1, -2  # slot_of values of a page that has no DRAM row


class OffloadCapacityError(RuntimeError):
    """A fixed-size offload structure (mirror pages, rows, per-request history) is full."""


class ReleasedPageError(RuntimeError):
    """A mirror page without a DRAM slot was read (or a released one written): a bug, never stale bytes."""


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of this host in bytes, or None where it cannot be read (not Linux)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(n_bytes: int, processes: int = 1, meminfo: str = "/proc/meminfo", headroom: float = 0.9) -> None:
    """Refuse a mirror that this host cannot hold: `processes` such mirrors (one per local rank) must fit in
    `headroom` of MemAvailable. Raises OffloadCapacityError with the numbers (instead of an OOM kill later)."""
    avail = host_available_bytes(meminfo)
    need = n_bytes * max(1, processes)
    if avail is not None and need > headroom * avail:
        gib = 2**30
        raise OffloadCapacityError(
            f"host mirror needs {n_bytes / gib:.1f} GiB x {processes} local rank(s) = {need / gib:.1f} GiB of "
            f"pinned host memory, but only {avail / gib:.1f} GiB is available ({headroom:.0%} usable). "
            "Lower --max-total-tokens / "
            "--context-length (the c4 pool size sets the mirror size), set SGLANG_PATHP_HOST_MIRROR_GB with the disk "
            "tier, or add host memory"
        )


def pinned_alloc_bytes(n_bytes: int, pinned: bool) -> int:
    """Host bytes one tensor of `n_bytes` takes. Pinned tensors come from torch's CUDA host allocator, which
    rounds every request up to the next power of two (its free lists are indexed by those sizes), so a pinned
    mirror tensor may take up to twice its size; pageable memory is taken as asked."""
    if n_bytes <= 0:
        return 0
    return 1 << (n_bytes - 1).bit_length() if pinned else n_bytes


def mirror_alloc_bytes(layout: OffloadLayout, n_slots: int, pinned: bool) -> int:
    """Host bytes a `HostMirror` of `n_slots` page slots allocates: its kv tensor [n_layers, n_slots,
    kv_page_bytes] and its Path-I index tensor [len(offload_index_layers), n_slots, index_page_bytes], each
    rounded as the allocator rounds it (`pinned_alloc_bytes`). What the start-up memory check counts."""
    kv = layout.n_layers * n_slots * layout.kv_page_bytes
    index = len(layout.offload_index_layers) * n_slots * layout.index_page_bytes
    return pinned_alloc_bytes(kv, pinned) + pinned_alloc_bytes(index, pinned)


def _host_empty(shape: tuple[int, ...], pin: bool) -> torch.Tensor:
    # Allocate pinned directly: pinning a pageable tensor afterwards would need twice the host RAM.
    return torch.zeros(shape, dtype=torch.uint8, pin_memory=pin)


class HostMirror:
    """kv: uint8 [n_layers, n_slots, kv_page_bytes]; index: uint8 [len(offload_index_layers), n_slots,
    index_page_bytes]; n_slots = n_pages unless a landing window (`slots`) is given (see the module doc).

    index row i holds layer `layout.offload_index_layers[i]` (Path-I). Target layers' index-K stays on the
    device (`TargetIndexPool`), so it is not mirrored. Invariants (windowed): `slot_of` int64 [n_pages]; the
    slots of owned pages and the free slot list partition range(n_slots); a free page has no slot.
    """

    def __init__(self, layout: OffloadLayout, n_pages: int, pin: bool | None = None, slots: int | None = None):
        if n_pages < 1:
            raise ValueError(f"HostMirror needs n_pages >= 1, got {n_pages}")
        if slots is not None and not 1 <= slots <= n_pages:
            raise ValueError(f"HostMirror: slots must lie in [1, n_pages={n_pages}], got {slots}")
        self.layout = layout
        self.n_pages = n_pages
        self.n_slots = n_pages if slots is None else int(slots)
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        self.kv = _host_empty((layout.n_layers, self.n_slots, layout.kv_page_bytes), self.pinned)
        self.index = _host_empty((len(layout.offload_index_layers), self.n_slots, layout.index_page_bytes), self.pinned)
        # A stack of candidates (pop() hands out low ids first) plus the set of pages actually free: `claim`
        # only drops a page from the set, and `alloc` skips stack entries that are no longer in it.
        self._free = list(range(n_pages - 1, -1, -1))
        self._free_set = set(self._free)
        self.slot_of: torch.Tensor | None = None if slots is None else torch.full((n_pages,), FRESH, dtype=torch.int64)
        self._free_slots = list(range(self.n_slots - 1, -1, -1)) if slots is not None else []
        self.peak_slots = 0  # most slots in use at once (windowed), for tests and the bench

    @property
    def free_pages(self) -> int:
        """Free page ids (what an admission's page table needs; a window's DRAM slots are `free_slots`)."""
        return len(self._free_set)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots) if self.slot_of is not None else len(self._free_set)

    @property
    def slots_in_use(self) -> int:
        """DRAM page rows holding a live page (= pages in use without a window)."""
        return self.n_slots - self.free_slots

    @property
    def page_bytes(self) -> int:
        """Bytes of one page slot: all KV layers + the Path-I index layers."""
        return self.kv.shape[0] * self.kv.shape[2] + self.index.shape[0] * self.index.shape[2]

    @property
    def physical_bytes(self) -> int:
        """Host bytes the mirror's tensors take (n_slots x page_bytes)."""
        return self.n_slots * self.page_bytes

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the allocator reserved for the mirror's tensors (pinned: each rounded to a power of two)."""
        return sum(pinned_alloc_bytes(t.numel() * t.element_size(), self.pinned) for t in (self.kv, self.index))

    def alloc(self, n: int) -> list[int]:
        """n free page ids (low ids first). Windowed: no slot yet, a page takes one at its first write."""
        if n > len(self._free_set):
            raise OffloadCapacityError(
                f"host mirror: need {n} pages, {len(self._free_set)} of {self.n_pages} free "
                f"(raise EngineConfig.mirror_pages)"
            )
        out: list[int] = []
        while len(out) < n:
            p = self._free.pop()
            if p in self._free_set:
                self._free_set.discard(p)
                out.append(p)
        return out

    def claim(self, pages: list[int]) -> list[int]:
        """Take these exact pages (all or none), each with a slot when windowed (their bytes arrive from outside).
        Raises if one is out of range, repeated or not free, or if the window has too few free slots."""
        bad = [p for p in pages if not 0 <= p < self.n_pages]
        if bad:
            raise IndexError(f"host mirror: pages {bad[:8]} outside [0, {self.n_pages})")
        if len(set(pages)) != len(pages):
            raise ValueError(f"host mirror: claim lists a page twice: {pages[:16]}")
        busy = [p for p in pages if p not in self._free_set]
        if busy:
            raise RuntimeError(f"host mirror: pages {busy[:8]} are already owned by a request")
        if self.slot_of is not None:
            self._take_slots(list(pages))
        self._free_set.difference_update(pages)
        return list(pages)

    def release(self, pages: list[int]) -> int:
        """Give back the slots of these owned pages: the disk tier holds their bytes now (windowed; a no-op on a
        full-size mirror). Returns the slots freed. Reading such a page raises from then on."""
        if self.slot_of is None:
            return 0
        free = [p for p in pages if p in self._free_set]
        if free:
            raise RuntimeError(f"host mirror: release of pages {free[:8]} that no request owns")
        n = 0
        for p in pages:
            s = int(self.slot_of[p])
            if s >= 0:
                self._free_slots.append(s)
                n += 1
            self.slot_of[p] = RELEASED
        return n

    def free(self, pages: list[int]) -> None:
        fresh = [p for p in pages if p not in self._free_set]
        if self.slot_of is not None:
            for p in fresh:
                s = int(self.slot_of[p])
                if s >= 0:
                    self._free_slots.append(s)
                self.slot_of[p] = FRESH
        self._free_set.update(fresh)
        self._free.extend(reversed(fresh))
        if len(self._free) > 4 * self.n_pages:  # claims leave dead stack entries behind: compact now and then
            self._free = sorted(self._free_set, reverse=True)

    def _take_slots(self, pages: list[int]) -> None:
        if len(pages) > len(self._free_slots):
            raise OffloadCapacityError(
                f"host mirror landing window: need {len(pages)} page slots, {len(self._free_slots)} of {self.n_slots} "
                "free (raise SGLANG_PATHP_HOST_MIRROR_GB)"
            )
        for p in pages:
            self.slot_of[p] = self._free_slots.pop()
        self.peak_slots = max(self.peak_slots, self.slots_in_use)

    def rows(self, pages: torch.Tensor, write: bool = False) -> torch.Tensor:
        """The tensor rows (slots) of mirror pages [n] (int64 [n]; the ids themselves without a window).

        write=True: a page with no bytes yet takes a slot (OffloadCapacityError when the window is full).
        Raises ReleasedPageError for a released page, or (reading) a page never written."""
        if self.slot_of is None:
            return pages
        pages = pages.cpu().long()
        s = self.slot_of[pages]
        if write and bool((s == FRESH).any()):
            self._take_slots(pages[s == FRESH].unique().tolist())
            s = self.slot_of[pages]
        if bool((s < 0).any()):
            p = int(pages[s < 0][0])
            why = "was released to the disk tier" if int(self.slot_of[p]) == RELEASED else "holds no bytes yet"
            raise ReleasedPageError(
                f"host mirror: page {p} {why}: it has no DRAM slot to {'write' if write else 'read'}"
            )
        return s

    def row(self, page: int, write: bool = False) -> int:
        """`rows` of one page."""
        return int(self.rows(torch.tensor([page], dtype=torch.int64), write)[0])

    def write(self, mchunks: torch.Tensor, kv: torch.Tensor, index: torch.Tensor | None) -> None:
        """Write chunk rows at mirror chunks (mirror_page * page_chunks + off).

        kv: [n_layers, n, kv_chunk_bytes] uint8; index: [n_layers, n, index_chunk_bytes] uint8 (all layers; only the
        Path-I layers are kept here) or None when Path-I is off.
        """
        pc = self.layout.page_chunks
        mchunks = mchunks.cpu().long()
        self.layout.kv.write_chunks(self.kv, self.rows(mchunks // pc, write=True), mchunks % pc, kv.cpu())
        if index is not None:
            self.write_index(mchunks, index)

    def write_index(self, mchunks: torch.Tensor, index: torch.Tensor) -> None:
        """Path-I rows only. index: [n_layers, n, index_chunk_bytes] uint8 for all layers."""
        ol = self.layout.offload_index_layers
        if ol:
            pc = self.layout.page_chunks
            mchunks = mchunks.cpu().long()
            self.layout.index.write_chunks(
                self.index, self.rows(mchunks // pc, write=True), mchunks % pc, index.cpu()[list(ol)]
            )
