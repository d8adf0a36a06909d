"""The batch's pool page table on the host, read ahead so a page opening never waits for the device.

sglang keeps `req_to_token` on the device only; the adapter needs a row's pool pages on the host when the row is
new (its history) and when its c4 history enters a new page. A row's tokens enter full page k (token 256k) three
decode steps before its c4 history does (chunk 64k closes with token 256k + 3), and sglang writes the page's locs
into `req_to_token` before the first of those forwards. So on the step the tokens enter a page, the table is
copied into pinned host memory without a host wait (non_blocking, an event); three steps later the page opens
from that copy, long complete under the overlap scheduler (which is at most one forward behind). A new request,
or a read-ahead not complete (or missing), is read at once: a host read, the one left on admitting steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flashmemory.offload import streams


class PageReads:
    """Read-ahead of the page table (see the module doc); page_chunks: c4 entries per page (4 tokens each)."""

    def __init__(self, page_chunks: int):
        self.pc = page_chunks
        self._ahead: tuple[list[str], torch.Tensor, Any] | None = None  # (rids, pinned [B, P] int64, event)

    def pool_pages(
        self,
        rids: Sequence[str],
        page_table: torch.Tensor,
        known: Sequence[list[int] | None],
        after: Sequence[int],
        seq_lens: Sequence[int],
    ) -> list[list[int]] | None:
        """Each batch row's pool pages (a full table row, -1 past its length), or None when every row's `known`
        pages (None: a new row) cover the `after` c4 chunks it has after this step. page_table: [B, P] on the
        device; seq_lens: [B] tokens, the current one included."""
        pc = self.pc
        need = [-(-a // pc) for a in after]
        short = [k is None or n > len(k) for k, n in zip(known, need)]
        out = None
        if any(short):
            ahead = self._complete()
            ok = all(
                not s or (k is not None and len(ahead.get(rid, ())) >= n and min(ahead[rid][:n], default=0) >= 0)
                for rid, k, n, s in zip(rids, known, need, short)
            )
            if ok:  # page opens of running rows, from the read-ahead
                out = [ahead[rid] if s else list(k) for rid, k, s in zip(rids, known, short)]
            else:  # a new row (or a read-ahead missing / not complete): read now
                out = page_table.cpu().long().tolist()
        ahead_rows = dict(zip(self._ahead[0], range(len(self._ahead[0])))) if self._ahead is not None else {}
        entering = [
            rid for rid, s, n in zip(rids, seq_lens, need) if -(-int(s) // (4 * pc)) > n and rid not in ahead_rows
        ]
        if entering and streams.streams_on(page_table.device):
            self._stage(list(rids), page_table)
        return out

    def _stage(self, rids: list[str], page_table: torch.Tensor) -> None:
        host = streams.pinned_empty(tuple(page_table.shape), torch.int64)
        host.copy_(page_table.long(), non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(page_table.device))
        self._ahead = (rids, host, done)

    def _complete(self) -> dict[str, list[int]]:
        """The read-ahead's rows by rid if its copy is complete (then it is used up), else {}."""
        if self._ahead is None or not self._ahead[2].query():
            return {}
        rids, host, _ = self._ahead
        self._ahead = None
        return dict(zip(rids, host.tolist()))
