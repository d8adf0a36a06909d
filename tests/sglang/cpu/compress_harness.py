"""Drive the CPU compressor the way sglang's backend does: batches of requests, chunked prefill, decode steps.

Per step: plan (compress_plan) -> compress_forward -> compress_norm_rope_store, with sglang-shaped inputs: a
req_to_token table, a permuted full->SWA mapping (the c4 state ring lives in SWA pages), a state pool filled
with NaN (any read of a row that was never written shows up as NaN), and paged c4/c128 pools whose pages are
permuted per request and prefilled with random bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashmemory.sglang.cpu.ops.compress_plan import plan_decode, plan_prefill, unpack_plan_c, unpack_plan_d
from flashmemory.sglang.cpu.ops.compressor import compress_forward
from flashmemory.sglang.cpu.ops.norm_rope import compress_norm_rope_store, cos_sin_table, norm_rope
from flashmemory.sglang.cpu.ops.stores import index_page_format, kv_page_format

MAX_LEN = 512
SWA_PAGE = 16
POOL_PAGE = 64  # compressed entries per pool page (sglang: 256 tokens / 4 for c4; the store is page-size generic)
N_REQ_SLOTS = 4


@dataclass
class CompressorSetup:
    ratio: int
    head_dim: int
    ape: torch.Tensor  # [W, D] in sglang's (hot-fixed) layout
    norm_weight: torch.Tensor  # [D] fp32
    eps: float
    freqs_cis: torch.Tensor  # complex [max_pos, 32]


@dataclass
class Harness:
    setup: CompressorSetup
    seed: int = 0
    recorded: dict = field(default_factory=dict)  # (rid, entry) -> fp32 normed+roped entry (before the store)

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        s = self.setup
        coff = 2 if s.ratio == 4 else 1
        self.width = 2 * coff * s.head_dim
        self.req_to_token = (torch.arange(N_REQ_SLOTS).unsqueeze(1) * 1000 + torch.arange(MAX_LEN)).to(torch.int32)
        # The planner needs swa_page % ring == 0; c128's ring is per request, so its SWA pages do not matter.
        self.swa_page = SWA_PAGE if s.ratio == 4 else 256
        sp = self.swa_page
        n_swa_pages = N_REQ_SLOTS * MAX_LEN // sp
        swa_perm = torch.randperm(n_swa_pages, generator=g)
        full = torch.arange(N_REQ_SLOTS * 1000)
        rid, pos = full // 1000, full % 1000
        page = swa_perm[(rid * (MAX_LEN // sp) + (pos // sp).clamp(max=MAX_LEN // sp - 1)) % n_swa_pages]
        self.full_to_swa = (page * sp + pos % sp).long()
        self.ring = 8 if s.ratio == 4 else 128
        rows = n_swa_pages * self.ring if s.ratio == 4 else N_REQ_SLOTS * self.ring
        self.state = torch.full((rows + s.ratio, self.width), float("nan"))
        self.entries_per_req = MAX_LEN // s.ratio
        n_pool_pages = N_REQ_SLOTS * -(-self.entries_per_req // POOL_PAGE) + 3
        self.pool_perm = torch.randperm(n_pool_pages, generator=g)
        self.fmt = kv_page_format(POOL_PAGE) if s.head_dim == 512 else index_page_format(POOL_PAGE)
        self.pool = torch.randint(0, 256, (n_pool_pages, self.fmt.page_bytes), dtype=torch.uint8, generator=g)

    def entry_loc(self, rid: int, n: torch.Tensor) -> torch.Tensor:
        pages_per_req = -(-self.entries_per_req // POOL_PAGE)
        return self.pool_perm[rid * pages_per_req + n // POOL_PAGE] * POOL_PAGE + n % POOL_PAGE

    def step(self, kv_score: dict[int, torch.Tensor], batch: list[tuple[int, int, int]], decode: bool) -> None:
        """One forward: batch = [(rid, start, end)], tokens [start, end) of each request's kv_score rows."""
        s = self.setup
        rids = torch.tensor([b[0] for b in batch])
        seq = torch.tensor([b[2] for b in batch])
        ext = torch.tensor([b[2] - b[1] for b in batch])
        x = torch.cat([kv_score[r][a:e] for r, a, e in batch])
        pos = torch.cat([torch.arange(a, e) for _, a, e in batch])
        tok_rid = torch.cat([torch.full((e - a,), r) for r, a, e in batch])
        out_loc = torch.cat([self.entry_loc(r, torch.arange(a, e) // s.ratio) for r, a, e in batch])
        if decode:
            assert bool((ext == 1).all())
            plan_d = plan_decode(s.ratio, rids, self.req_to_token, self.full_to_swa, seq, self.swa_page, self.ring)
            items = (plan_d,)
        else:
            items = plan_prefill(
                s.ratio, rids, seq, ext, self.req_to_token, self.full_to_swa, self.swa_page, self.ring, int(ext.sum())
            )
        plan_t = _Plan(s.ratio, decode, items)
        out = compress_forward(
            self.state.view(-1, s.ratio, self.width), x, s.ape, plan_t, head_dim=s.head_dim, compress_ratio=s.ratio
        )
        compress_norm_rope_store(
            out,
            plan_t,
            norm_weight=s.norm_weight,
            norm_eps=s.eps,
            freq_cis=s.freqs_cis,
            out_loc=out_loc,
            kvcache=self.pool,
            page_size=POOL_PAGE,
        )
        self._record(out, plan_t, pos, tok_rid)

    def _record(self, out: torch.Tensor, plan: "_Plan", pos: torch.Tensor, tok_rid: torch.Tensor) -> None:
        s = self.setup
        if plan.is_decode:
            p = unpack_plan_d(plan[1])
            rows = torch.nonzero(p.seq_len % s.ratio == 0).flatten()
            toks = rows
        else:
            p = unpack_plan_c(plan[1])
            rows = torch.nonzero(p.valid).flatten()
            toks = p.ragged_id[rows]
        if rows.numel() == 0:
            return
        cs = cos_sin_table(s.freqs_cis)[p.seq_len[rows] - s.ratio]
        y = norm_rope(out[rows], s.eps, s.norm_weight, cs)
        for k in range(rows.numel()):
            self.recorded[(int(tok_rid[toks[k]]), int(pos[toks[k]]) // s.ratio)] = y[k]

    def read_entries(self, rid: int, n_entries: int) -> torch.Tensor:
        """uint8 [n_entries, entry_bytes] of request rid from the pool."""
        locs = self.entry_loc(rid, torch.arange(n_entries))
        return self.fmt.read_chunks(self.pool, locs // POOL_PAGE, locs % POOL_PAGE)


class _Plan(tuple):
    """Stands in for sglang's CompressorPrefillPlan / CompressorDecodePlan NamedTuples (index 1.. = tensors)."""

    def __new__(cls, ratio: int, decode: bool, items: tuple):
        obj = super().__new__(cls, (ratio, *items))
        obj.compress_ratio, obj.is_decode = ratio, decode
        return obj


def run(
    setup: CompressorSetup, kv_score: dict[int, torch.Tensor], schedule: list[tuple[list, bool]], seed: int = 0
) -> Harness:
    h = Harness(setup, seed)
    for batch, decode in schedule:
        h.step(kv_score, batch, decode)
    return h
