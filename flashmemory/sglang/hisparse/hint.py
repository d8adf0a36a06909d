"""Level 1 as the hint source of the HiSparse prefetch mode (SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1 together with
SGLANG_RETRIEVER_INLINE_CKPT): FlashMemory's Level 1 (`residency.level1.Level1`: cadence, worker thread, the
retriever scorer, the page policy) runs on a HiSparse decode server with Path-P off, and each cycle's resident set
becomes the request's prefetch hint (`hisparse_prefetch_state.resident_hint` -> `.state().set_hint`).

`HintSource` is the offload-engine side Level 1 talks to, reduced to what a hint needs; nothing is mirrored,
reserved or recalled:
- rows: one per live request id, numbered once (never reused, so a row's generation is constant: 0);
  `n_chunks` = the request's complete c4 entries after the step; its c4 page table is the one sglang's indexer
  reads (`tables.c4_page_table` over `req_to_token`), refreshed each decode step.
- `target_keys(row, layer)`: the row's dequantized index keys fp32 [n_chunks, D], read from sglang's c4 index-K
  pool on the device (HiSparse keeps that pool full size: only the c4 KV lives in its hot buffer).
- `recaller.recall(reqs)`: instead of copying pages, each request's pages in priority order (scored pages by
  score, then the recency tail) go to `publish`, which the mode binds to `resident_hint` (positions without the
  newest top-k entries) and `hisparse.state.state().set_hint` (capped at the cycle budget, <= H - K).
The side band's inputs (hidden states of the retriever's target layers, positions) are captured by this mode's own
indexer hook (`hisparse_prefetch.around_indexer`), into the runtime's static side band (`runtime.Runtime`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload.recall import RecallRequest
from flashmemory.residency.level1 import Level1, retriever_scorer
from flashmemory.residency.policy import ThresholdPagePolicy
from flashmemory.retriever.fp8 import dequantize_chunks, pages_to_chunks
from flashmemory.sglang.decode.core_config import core_config
from flashmemory.sglang.decode.geometry import pool_buffers, read_geometry

logger = logging.getLogger(f"sglang.{__name__}")


@dataclass(frozen=True)
class HintLayout:
    """What Level 1 and the retriever scorer read of the offload layout."""

    page_chunks: int  # c4 entries per page (64)
    target_layers: tuple[int, ...]  # c4 layers the retriever scores


@dataclass
class _Row:
    rid: str
    n_chunks: int  # complete c4 entries after the step
    pages: torch.Tensor  # int64 [P] c4 pool pages of the row's logical pages (device of the pool)


class _Order:
    """`OffloadEngine.order`'s one call from Level 1's worker: select the pool's device in the new thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def set_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)


class HintSource:
    """Level 1 over sglang's c4 index-K pool, publishing each cycle's resident set as a prefetch hint."""

    def __init__(
        self, pool: Any, env: FlashMemoryEnv, retriever: Any, publish: Callable[[str, torch.Tensor, int], int]
    ) -> None:
        """pool: sglang's DSv4 token-to-KV pool; retriever: a JointRetriever on the pool's device;
        publish(rid, pages int64 [P] in priority order, c4 entries) -> positions now pending for the request."""
        geo = read_geometry(pool)
        self.ix = pool_buffers(pool)[1]
        self.head_dim = geo.index_head_dim
        self.device = self.ix[0].device
        core = core_config(env, geo)
        self.layout = HintLayout(geo.page_chunks, tuple(env.retriever_layers))
        self.publish = publish
        self.lock = threading.Lock()
        self.rows: dict[int, _Row] = {}
        self.by_rid: dict[str, int] = {}
        self._next = 0
        self.counts = {"cycles": 0, "hints": 0, "positions": 0}
        self.order = _Order(self.device)
        self.recaller = self
        self.l1 = Level1(
            self, retriever_scorer(retriever, self, core.ensemble), ThresholdPagePolicy(core.selection), core.level1
        )

    # --- what Level 1 reads (OffloadEngine's names) -----------------------------------------------------------
    def snapshot_rows(self) -> dict[int, tuple[int, int]]:
        with self.lock:
            return {r: (0, st.n_chunks) for r, st in self.rows.items()}

    def gen(self, row: int) -> int:
        with self.lock:
            if row not in self.rows:
                raise KeyError(row)
            return 0

    def note(self, row: int, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def target_keys(self, row: int, layer: int) -> torch.Tensor:
        """Dequantized index keys fp32 [n_chunks, D] of c4 layer `layer` for the row's whole history; KeyError
        once the request is gone (Level 1 then drops the cycle)."""
        with self.lock:
            st = self.rows[row]
            pages, n = st.pages, st.n_chunks
        rows = self.ix[layer][pages[: -(-n // self.layout.page_chunks)].to(self.device)]
        return dequantize_chunks(pages_to_chunks(rows, n, self.head_dim, self.layout.page_chunks))

    def prefetch(self, reqs: Sequence[RecallRequest]) -> None:
        """No disk tier in this mode: nothing to read ahead."""

    def recall(self, reqs: Sequence[RecallRequest]) -> None:
        """Publish each live request's pages as its hint: scored pages by priority, then the recency tail."""
        for rq in reqs:
            with self.lock:
                st = self.rows.get(rq.row)
                rid, n = (st.rid, st.n_chunks) if st is not None else ("", 0)
            if st is None:
                continue
            order = sorted(range(len(rq.pages)), key=lambda i: (rq.priority[i] == float("inf"), -rq.priority[i]))
            pages = torch.tensor([rq.pages[i] for i in order], dtype=torch.int64)
            listed = self.publish(rid, pages, n)
            self.note(rq.row, "cycles")
            self.note(rq.row, "hints", int(listed > 0))
            self.note(rq.row, "positions", listed)

    # --- driven by the mode's hooks ----------------------------------------------------------------------------
    def on_decode(
        self, rids: Sequence[str], table: torch.Tensor, seq_lens: torch.Tensor, snapshot: dict[str, torch.Tensor] | None
    ) -> list[int]:
        """After a decode forward: rids [B] in batch order, table int64 [B, P] c4 pool pages (-1 past a row's
        length), seq_lens int64 [B] tokens incl. this step's. Rows of requests not in the batch are dropped; the
        due rows' cycles are submitted (None snapshot: the side band is stale, no cycle). Returns rows submitted."""
        rows = []
        with self.lock:
            live = set(rids)
            for rid in [r for r in self.by_rid if r not in live]:
                self.rows.pop(self.by_rid.pop(rid), None)
            for b, rid in enumerate(rids):
                row = self.by_rid.get(rid)
                if row is None:
                    row = self.by_rid[rid] = self._next
                    self._next += 1
                self.rows[row] = _Row(rid, int(seq_lens[b]) // 4, table[b])
                rows.append(row)
        if not snapshot or not rows:
            return []
        n = min(len(rows), snapshot["positions"].shape[0])
        hidden = {l: snapshot[f"hidden_{l}"][:n] for l in self.layout.target_layers if f"hidden_{l}" in snapshot}
        return self.l1.on_step(rows[:n], hidden, snapshot["positions"][:n])

    def forget(self, rid: str) -> None:
        with self.lock:
            row = self.by_rid.pop(rid, None)
            if row is not None:
                self.rows.pop(row, None)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)

    def close(self) -> None:
        self.l1.close()
