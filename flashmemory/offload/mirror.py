"""The host mirror: the full history of every live request, per layer, in page rows.

Pinned when CUDA is present (so recall can copy asynchronously), plain memory on CPU.
Mirror pages are handed to requests from a free list (`alloc`), or claimed by id (`claim`) when the caller
owns the page numbering (sglang's c4 pool pages, so PD transfers can land in the mirror directly); a
request's logical page p lives at mirror page `mpages[p]`. Freed pages keep stale bytes, but the lookup table
never points at them.
"""

from __future__ import annotations

import torch

from flashmemory.offload.layout import OffloadLayout


class OffloadCapacityError(RuntimeError):
    """A fixed-size offload structure (mirror pages, rows, per-request history) is full."""


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
        gib = 2 ** 30
        raise OffloadCapacityError(
            f"host mirror needs {n_bytes / gib:.1f} GiB x {processes} local rank(s) = {need / gib:.1f} GiB of pinned host "
            f"memory, but only {avail / gib:.1f} GiB is available ({headroom:.0%} usable). Lower --max-total-tokens / "
            "--context-length (the c4 pool size sets the mirror size) or add host memory")


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
        # A stack of candidates (pop() hands out low ids first) plus the set of pages actually free: `claim`
        # only drops a page from the set, and `alloc` skips stack entries that are no longer in it.
        self._free = list(range(n_pages - 1, -1, -1))
        self._free_set = set(self._free)

    @property
    def free_pages(self) -> int:
        return len(self._free_set)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free_set):
            raise OffloadCapacityError(f"host mirror: need {n} pages, {len(self._free_set)} of {self.n_pages} free "
                                       f"(raise EngineConfig.mirror_pages)")
        out: list[int] = []
        while len(out) < n:
            p = self._free.pop()
            if p in self._free_set:
                self._free_set.discard(p)
                out.append(p)
        return out

    def claim(self, pages: list[int]) -> list[int]:
        """Take these exact pages (all or none). Raises if one is out of range, repeated or not free."""
        bad = [p for p in pages if not 0 <= p < self.n_pages]
        if bad:
            raise IndexError(f"host mirror: pages {bad[:8]} outside [0, {self.n_pages})")
        if len(set(pages)) != len(pages):
            raise ValueError(f"host mirror: claim lists a page twice: {pages[:16]}")
        busy = [p for p in pages if p not in self._free_set]
        if busy:
            raise RuntimeError(f"host mirror: pages {busy[:8]} are already owned by a request")
        self._free_set.difference_update(pages)
        return list(pages)

    def free(self, pages: list[int]) -> None:
        fresh = [p for p in pages if p not in self._free_set]
        self._free_set.update(fresh)
        self._free.extend(reversed(fresh))
        if len(self._free) > 4 * self.n_pages:  # claims leave dead stack entries behind: compact now and then
            self._free = sorted(self._free_set, reverse=True)

    def write(self, mchunks: torch.Tensor, kv: torch.Tensor, index: torch.Tensor | None) -> None:
        """Write chunk rows at mirror chunks (mirror_page * page_chunks + off).

        kv: [n_layers, n, kv_chunk_bytes] uint8; index: [n_layers, n, index_chunk_bytes] uint8 (all layers; only the
        Path-I layers are kept here) or None when Path-I is off.
        """
        pc = self.layout.page_chunks
        mchunks = mchunks.cpu().long()
        self.layout.kv.write_chunks(self.kv, mchunks // pc, mchunks % pc, kv.cpu())
        if index is not None:
            self.write_index(mchunks, index)

    def write_index(self, mchunks: torch.Tensor, index: torch.Tensor) -> None:
        """Path-I rows only. index: [n_layers, n, index_chunk_bytes] uint8 for all layers."""
        ol = self.layout.offload_index_layers
        if ol:
            pc = self.layout.page_chunks
            mchunks = mchunks.cpu().long()
            self.layout.index.write_chunks(self.index, mchunks // pc, mchunks % pc, index.cpu()[list(ol)])
