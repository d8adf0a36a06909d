"""The lookup table: mirror chunk -> reserve cell, -1 when not resident. The single source of residency truth.

Keyed by mirror chunk (mirror_page * page_chunks + off), not by a request's logical index: a mirror page
belongs to one request at a time and its entries are cleared before the page is freed, so a reused row or
page cannot inherit another request's cells. The last entry is a sentinel that always reads -1; invalid
lookups (padding rows, negative indices, pages past a history) are routed to it instead of out of bounds.
"""

from __future__ import annotations

import torch

from flashmemory.offload import streams


class ChunkLUT:
    """table: int32 [n_pages * page_chunks + 1]; row_pages: int32 [max_rows, max_pages] (logical page -> mirror
    page)."""

    def __init__(
        self, n_pages: int, page_chunks: int, max_rows: int, max_pages: int, device: torch.device | str = "cpu"
    ):
        self.pc = page_chunks
        self.sentinel = n_pages * page_chunks
        self.table = torch.full((self.sentinel + 1,), -1, dtype=torch.int32, device=device)
        self.row_pages = torch.full((max_rows, max_pages), -1, dtype=torch.int32, device=device)

    def set_range(self, mpage: int, start: int, stop: int, first_cell: int) -> None:
        """Entries [start, stop) of mirror page `mpage` -> cells first_cell + off (a page mapped to one block)."""
        base = mpage * self.pc
        self.table[base + start : base + stop] = torch.arange(
            first_cell + start, first_cell + stop, dtype=torch.int32, device=self.table.device
        )

    def set(self, mchunks: torch.Tensor, cells: torch.Tensor) -> None:
        self.table[streams.like(mchunks, self.table).long()] = streams.like(cells, self.table).to(torch.int32)

    def clear_page(self, mpage: int) -> None:
        self.table[mpage * self.pc : (mpage + 1) * self.pc] = -1

    def _rows(self, mpages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The table without its sentinel as [n_pages, pc] (a view), and mirror pages [n] as an int64 index."""
        return self.table[:-1].view(-1, self.pc), streams.like(torch.tensor(mpages, dtype=torch.int64), self.table)

    def clear_pages(self, mpages: list[int]) -> None:
        """`clear_page` for each of mirror pages [n], as one indexed fill."""
        if mpages:
            view, idx = self._rows(mpages)
            view.index_fill_(0, idx, -1)

    def set_pages(self, mpages: list[int], counts: list[int], first_cells: list[int]) -> None:
        """`set_range(mpages[i], 0, counts[i], first_cells[i])` for all i ([n] lists); the pages must be distinct.
        Full pages (counts[i] == page_chunks) go in one indexed row copy, the few partial ones (a history's last
        page) one by one."""
        full = [i for i, c in enumerate(counts) if c == self.pc]
        if full:
            view, idx = self._rows([mpages[i] for i in full])
            offs = torch.arange(self.pc, dtype=torch.int32)
            cells = torch.tensor([first_cells[i] for i in full], dtype=torch.int32).unsqueeze(1) + offs  # [n, pc]
            view.index_copy_(0, idx, streams.like(cells, self.table))
        if len(full) < len(mpages):
            is_full = set(full)
            for i, (mp, c, fc) in enumerate(zip(mpages, counts, first_cells)):
                if i not in is_full:
                    self.set_range(mp, 0, c, fc)

    def mirror_chunks(self, rows: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """rows: [B] int (-1 = padding); chunks: [B, K] logical chunk ids (-1 = none) -> int64 [B, K] mirror chunks,
        the sentinel where invalid. Static shapes, no host sync."""
        max_rows, max_pages = self.row_pages.shape
        rows = streams.like(rows, self.table).long()
        chunks = streams.like(chunks, self.table).long()
        page = torch.div(chunks, self.pc, rounding_mode="floor")
        ok = (rows.unsqueeze(1) >= 0) & (chunks >= 0) & (page < max_pages)
        r = rows.clamp(0, max_rows - 1).unsqueeze(1).expand_as(chunks)
        mpage = self.row_pages[r, page.clamp(0, max_pages - 1)].long()
        ok = ok & (mpage >= 0)
        m = mpage * self.pc + chunks % self.pc
        return torch.where(ok, m, torch.full_like(m, self.sentinel))

    def cells(self, rows: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """int32 [B, K] reserve cells of logical chunks [B, K] of rows [B]; -1 where not resident or invalid."""
        return self.table[self.mirror_chunks(rows, chunks)]
