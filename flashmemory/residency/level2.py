"""Level 2: per-step top-k restricted to resident chunks, in two modes, with static-shape buffers.

mask mode            native logits over the full history; non-resident columns -> -inf before top-k.
score-resident mode  score only the row's resident pages (compact table built by the engine), take top-k over
                     those columns and map each column straight to its reserve cell.
Both return logical chunk ids and reserve cells, -1 where a pick is invalid (a -inf logit), so a
non-resident chunk is never returned. Buffers are sized from configuration (max_batch, max_chunks,
resident-page cap), never from the batch seen at capture time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashmemory.offload.engine import OffloadEngine
from flashmemory.retriever.fp8 import FP8
from flashmemory.retriever.model import relu_head_scores

NEG_INF = float("-inf")


class Level2Out(NamedTuple):
    chunks: torch.Tensor  # int64 [B, k] logical chunk ids, -1 invalid
    cells: torch.Tensor  # int32 [B, k] reserve cells, -1 invalid
    values: torch.Tensor  # fp32 [B, k] logits of the picks (-inf where invalid)


def paged_index_logits(
    q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, page_chunks: int = 64
) -> torch.Tensor:
    """Reference scorer over paged fp8 index-K: logits[b, t*pc + c] = sum_h relu(q[b,h] . k) * w[b,h], where
    k = fp8 * scale of chunk c of page table[b, t].

    q: [B, H, D] fp32; w: [B, H] fp32; pages: uint8 [P, pc*(D+4)] ([pc*D fp8 | pc*4 fp32 scale]);
    table: int [B, K], -1 = empty. Returns fp32 [B, K*pc]; columns of empty pages are -inf.
    """
    b, h, d = q.shape
    if pages.dim() != 2 or pages.shape[1] != page_chunks * (d + 4):
        raise ValueError(f"pages must be [P, {page_chunks * (d + 4)}] for head_dim {d}, got {tuple(pages.shape)}")
    if table.dim() != 2 or table.shape[0] != b:
        raise ValueError(f"table must be [B={b}, K], got {tuple(table.shape)}")
    k = table.shape[1]
    g = pages[table.clamp_min(0).long().to(pages.device)]  # [B, K, W]
    vals = g[..., : page_chunks * d].contiguous().view(FP8).reshape(b, k * page_chunks, d)
    scale = g[..., page_chunks * d :].contiguous().view(torch.float32).reshape(b, k * page_chunks)
    keys = vals.float() * scale.unsqueeze(-1)  # [B, K*pc, D]
    out = relu_head_scores(q.float(), w.float(), keys)
    empty = (table < 0).to(out.device).repeat_interleave(page_chunks, dim=1)
    return out.masked_fill(empty, NEG_INF)


class Level2:
    """Level-2 top-k over an `OffloadEngine`. rows: int [B] engine rows (-1 = padding), B <= max_batch."""

    def __init__(self, engine: OffloadEngine, max_batch: int, topk: int = 512):
        if max_batch < 1 or topk < 1:
            raise ValueError(f"Level2 needs max_batch >= 1 and topk >= 1, got {max_batch}, {topk}")
        self.engine, self.max_batch, self.topk = engine, max_batch, topk
        pc, dev = engine.layout.page_chunks, engine.device
        n, r = engine.cfg.max_chunks, engine.res_cap * pc
        self.cols = torch.arange(n, device=dev)
        self.res_off = torch.arange(r, device=dev) % pc
        self.masked = torch.empty(max_batch, n, dtype=torch.float32, device=dev)
        self.res_logits = torch.empty(max_batch, r, dtype=torch.float32, device=dev)
        self.out_chunks = torch.full((max_batch, topk), -1, dtype=torch.int64, device=dev)
        self.out_cells = torch.full((max_batch, topk), -1, dtype=torch.int32, device=dev)
        self.out_values = torch.full((max_batch, topk), NEG_INF, dtype=torch.float32, device=dev)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        rows = torch.as_tensor(rows, device=self.engine.device).long()
        if rows.dim() != 1 or not 1 <= rows.shape[0] <= self.max_batch:
            raise ValueError(f"rows must be [B] with 1 <= B <= max_batch={self.max_batch}, got {tuple(rows.shape)}")
        return rows

    def _emit(self, vals: torch.Tensor, chunk_of_col: torch.Tensor, cell_of_col: torch.Tensor, k: int) -> Level2Out:
        b, n = vals.shape
        kk = min(k, n)
        top, col = vals.topk(kk, dim=1)
        ok = top > NEG_INF
        self.out_chunks[:b].fill_(-1)
        self.out_cells[:b].fill_(-1)
        self.out_values[:b].fill_(NEG_INF)
        self.out_chunks[:b, :kk] = torch.where(ok, chunk_of_col.gather(1, col), -1)
        self.out_cells[:b, :kk] = torch.where(ok, cell_of_col.gather(1, col), -1).to(torch.int32)
        self.out_values[:b, :kk] = top
        return Level2Out(self.out_chunks[:b, :k], self.out_cells[:b, :k], self.out_values[:b, :k])

    def mask_topk(self, logits: torch.Tensor, rows: torch.Tensor, k: int | None = None) -> Level2Out:
        """Mask mode. logits: fp32 [B, N] native logits over each row's history (N <= max_chunks)."""
        k = k or self.topk
        rows = self._rows(rows)
        b, n = logits.shape
        if b != rows.shape[0] or n > self.cols.shape[0] or k > self.topk:
            raise ValueError(
                f"mask_topk: logits {tuple(logits.shape)}, rows [{rows.shape[0]}], k={k}; "
                f"need B to match, N <= {self.cols.shape[0]}, k <= {self.topk}"
            )
        chunks = self.cols[:n].unsqueeze(0).expand(b, n)
        with self.engine.lock:
            cells = self.engine.lut.cells(rows, chunks)
        out = self.masked[:b, :n]
        out.copy_(logits.to(out.device, torch.float32).masked_fill(cells < 0, NEG_INF))
        return self._emit(out, chunks, cells, k)

    def score_resident_topk(
        self, q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, layer: int, k: int | None = None
    ) -> Level2Out:
        """Score-resident mode for one c4 layer. q: [B, H, D] fp32, w: [B, H]. Target layers score the device
        index-K pool; Path-I layers score the index reserve (same block ids as the c4 KV)."""
        k = k or self.topk
        eng, pc = self.engine, self.engine.layout.page_chunks
        rows = self._rows(rows)
        b = rows.shape[0]
        if q.shape[0] != b or k > self.topk:
            raise ValueError(f"score_resident_topk: q {tuple(q.shape)} vs rows [{b}], k={k} (<= {self.topk})")
        r = rows.clamp_min(0)
        with eng.lock:
            if layer in eng.layout.target_layers:
                pages, table = eng.target.pages[eng.target.layers.index(layer)], eng.res_mpages[r]
            elif layer in eng.layout.offload_index_layers:
                pages, table = eng.reserve.index[eng.layout.offload_index_layers.index(layer)], eng.res_blocks[r]
            else:
                raise ValueError(
                    f"layer {layer}: score-resident needs a target layer {eng.layout.target_layers} "
                    f"or Path-I (index_offload) for non-target layers"
                )
            table = torch.where(rows.unsqueeze(1) >= 0, table, -1)
            lpage = torch.where(rows.unsqueeze(1) >= 0, eng.res_pages[r], -1).long()
            chunk = torch.where(
                lpage.repeat_interleave(pc, 1) >= 0, lpage.repeat_interleave(pc, 1) * pc + self.res_off, -1
            )
            cells = eng.lut.cells(rows, chunk)
            logits = paged_index_logits(q, w, pages, table, pc)
        out = self.res_logits[:b]
        out.copy_(logits.masked_fill(cells < 0, NEG_INF))
        return self._emit(out, chunk, cells, k)
