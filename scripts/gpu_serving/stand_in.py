"""The stand-ins `scripts/gpu_serving_check.py` drives the serving adapter with: a pool with the attributes the
adapter reads of sglang's DeepSeekV4TokenToKVPool (`StandInPool`, on any device), a batch of requests decoding
through the plugin's runtime (`Decode`: the hook sequence, as sglang calls it), and a counter of torch's
sync-debug warnings per thread (`SyncCounter`). torch and this repository only: no sglang import."""

from __future__ import annotations

import os
import threading
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload.layout import OffloadLayout
from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.sglang.decode.resident_topk import pool_locs, resident_view
from flashmemory.sglang.decode.runtime import Runtime
from flashmemory.sglang.plumbing.targets import features_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE, C4 = 256, 64  # tokens per pool page, c4 entries per page
KV_PAGE, IX_PAGE = 37440, 64 * 132  # sglang's c4 KV and index-K page rows (bytes)
SYNC_MSG = "synchronizing"


@dataclass(frozen=True)
class Sizes:
    n_c4: int  # c4 layers
    n_pages: int  # pool pages
    batch: int  # concurrent requests
    prompt_pages: int  # history at admission, pages
    steps: int
    hidden: int
    topk: int

    @classmethod
    def pick(cls, device: torch.device) -> Sizes:
        if device.type == "cuda":
            return cls(n_c4=21, n_pages=2048, batch=16, prompt_pages=24, steps=50, hidden=1024, topk=512)
        return cls(n_c4=3, n_pages=64, batch=3, prompt_pages=3, steps=24, hidden=16, topk=64)


class StandInPool:
    """What the adapter reads of sglang's DeepSeekV4TokenToKVPool: c4 KV and index-K page buffers per c4 layer,
    the page size and the layer mapping (layer 0 is a non-c4 layer, as in DeepSeek-V4)."""

    def __init__(self, sz: Sizes, device: torch.device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        rand = lambda width: torch.randint(0, 256, (sz.n_pages, width), dtype=torch.uint8, generator=g, device=device)  # noqa: E731
        kv = [rand(KV_PAGE) for _ in range(sz.n_c4)]
        ix = [rand(IX_PAGE) for _ in range(sz.n_c4)]
        scale = torch.full((sz.n_pages, C4), 0.01, device=device).view(torch.uint8).reshape(sz.n_pages, -1)
        for t in ix:  # finite fp32 scales and no fp8 NaN patterns, so dequantized keys are usable
            t[:, C4 * 128 :] = scale
            t[:, : C4 * 128] &= 0x77
        self.c4_kv_pool = types.SimpleNamespace(kv_buffer=kv, page_size=C4)
        self.c4_indexer_kv_pool = types.SimpleNamespace(index_k_with_scale_buffer=ix, page_size=C4, index_head_dim=128)
        self.page_size = PAGE
        self.layer_mapping = [(0, 0, None)] + [(4, i, self.c4_kv_pool) for i in range(sz.n_c4)]
        self.is_draft_worker = False


class Decode:
    """The serving runtime on the stand-in pool and a batch of requests that join, decode and leave."""

    def __init__(self, sz: Sizes, device: torch.device, seed: int = 0):
        self.sz, self.device = sz, device
        self.pool = StandInPool(sz, device, seed)
        kmax = max(2, sz.prompt_pages // 3)
        self.env = FlashMemoryEnv(
            decode_swap_p=True, retriever_layers=(1,), interval=4, page_kmax=kmax, decode_resident_chunks=128,
            decode_max_conc=sz.batch + 2, last_keep=C4, async_recall=True, score_resident=True, pd_c4_shrink=False,
            target_context=PAGE * (sz.prompt_pages + sz.steps // C4 + 4),
        )  # fmt: skip
        torch.manual_seed(seed)
        dims = RetrieverDims(hidden=sz.hidden, rank=8, n_heads=2, head_dim=128, rope_dim=64)
        retriever = JointRetriever((1,), dims)
        self.rt = Runtime()
        self.rt.configure(self.env, tuple(dict.fromkeys((*features_for(self.env), "level1"))), retriever)
        self.rt.attach_pool(self.pool)
        self.adapter = self.rt.engine
        self.free_pages = list(range(sz.n_pages - 1, -1, -1))
        self.max_ctx = PAGE * sz.n_pages
        self.r2t = torch.zeros((sz.batch + 2, self.max_ctx), dtype=torch.int64, device=device)
        self.reqs: dict[str, dict] = {}  # rid -> {slot, pages, seq}
        self.n_made = 0
        self.g = torch.Generator(device="cpu").manual_seed(seed + 1)

    def admit(self) -> None:
        slot = min(set(range(self.r2t.shape[0])) - {r["slot"] for r in self.reqs.values()})
        pages = [self.free_pages.pop() for _ in range(self.sz.prompt_pages + 1)]
        row = torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)], dtype=torch.int64)
        self.r2t[slot, : row.numel()] = row.to(self.device)
        # Lengths in step with the running requests (mod 4): chunks close on the same steps, so 3 steps in 4 are quiet.
        phase = next(iter(self.reqs.values()))["seq"] % 4 if self.reqs else 0
        seq = PAGE * self.sz.prompt_pages - 4 * int(torch.randint(1, PAGE // 8, (1,), generator=self.g)) + phase
        self.reqs[f"r{self.n_made}"] = dict(slot=slot, pages=pages, seq=seq)
        self.n_made += 1

    def finish(self, rid: str) -> None:
        self.free_pages.extend(self.reqs.pop(rid)["pages"])

    def batch(self) -> types.SimpleNamespace:
        """The forward batch as sglang hands it to the hooks: its lengths on the device and on the host, the
        request slots on the device."""
        rids = list(self.reqs)
        seq = [self.reqs[r]["seq"] for r in rids]
        slots = [self.reqs[r]["slot"] for r in rids]
        mode = types.SimpleNamespace(is_decode=lambda: True, is_idle=lambda: False)
        return types.SimpleNamespace(
            forward_mode=mode, rids=rids, req_pool_indices=torch.tensor(slots, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=self.device), seq_lens_cpu=torch.tensor(seq),
        )  # fmt: skip

    def c4_tables(self, rids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer metadata sglang hands the c4 layers: page table int32 [B, P], c4 lengths int32 [B]."""
        width = max(len(self.reqs[r]["pages"]) for r in rids)
        table = [self.reqs[r]["pages"] + [0] * (width - len(self.reqs[r]["pages"])) for r in rids]
        lens = [self.reqs[r]["seq"] // 4 for r in rids]
        return torch.tensor(table, dtype=torch.int32, device=self.device), torch.tensor(lens, device=self.device)

    def out_locs(self, rids: list[str]) -> torch.Tensor:
        """Pool locs of the c4 entry each row stores this step (-1: its 4-token group is not complete)."""
        out = []
        for r in rids:
            q = self.reqs[r]
            out.append(
                q["pages"][(q["seq"] // 4 - 1) // C4] * C4 + (q["seq"] // 4 - 1) % C4 if q["seq"] % 4 == 0 else -1
            )
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def picks(self, table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Level 2 on the resident view: the view's page table and lengths, and a top-k stand-in (the newest
        `topk` resident columns) as pool locs [B, topk], -1 past a row's length. Graph safe."""
        b = table.shape[0]
        view, vlens = resident_view(table, lens, self.rt.bufs.sel_pages[:b])
        cols = view.shape[1] * C4
        start = (vlens.long() - self.sz.topk).clamp_min(0).unsqueeze(1)
        j = (start + torch.arange(self.sz.topk, device=table.device)).clamp_max(cols - 1)
        locs = torch.gather(pool_locs(view, cols), 1, j)
        return torch.where(j < vlens.long().unsqueeze(1), locs, torch.full_like(locs, -1))

    def step(self, counter: SyncCounter | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step through the hooks; returns the last c4 layer's (picks, cells). What sglang would
        hand the hooks (the batch, its c4 metadata, the hidden states) is made outside `counter`'s window, so
        only the hooks' own syncs are counted."""
        rids = list(self.reqs)
        for r in rids:
            self.reqs[r]["seq"] += 1
        fb = self.batch()
        table, lens = self.c4_tables(rids)
        out = self.out_locs(rids)
        x = torch.empty(len(rids), self.sz.hidden, device=self.device).normal_()  # the model's hidden states
        pos = fb.seq_lens - 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the inputs are in place, as sglang's are when its hooks run
        picks = cells = None
        with counting(counter):
            self.rt.before_forward(fb, self.r2t)
            for l in range(self.sz.n_c4):
                if l in self.env.retriever_layers:
                    self.rt.capture_sideband_input(l, x, pos, False)
                picks = self.picks(table, lens)
                cells = self.adapter.cells_of(picks)
                self.adapter.refresh_from_pool(l, out)
            self.rt.after_decode_forward(fb)
        return picks, cells

    def bytes_match(self, picks: torch.Tensor, cells: torch.Tensor) -> tuple[int, int]:
        """(resident picks whose reserve bytes differ from the pool's over every c4 layer, resident picks)."""
        lay = OffloadLayout(n_layers=self.sz.n_c4, target_layers=(1,))
        ok = (picks >= 0) & (cells >= 0)
        if not bool(ok.any()):
            return 0, 0
        loc, cell = picks[ok].long().cpu(), cells[ok].long().cpu()
        bad = 0
        for l in range(self.sz.n_c4):
            pool = lay.kv.read_chunks(self.pool.c4_kv_pool.kv_buffer[l].cpu().unsqueeze(0), loc // C4, loc % C4)
            res = lay.kv.read_chunks(self.adapter.reserve_kv(l).cpu().unsqueeze(0), cell // C4, cell % C4)
            bad += int((pool != res).any(-1).sum())
        return bad, int(ok.sum())

    def close(self) -> None:
        self.adapter.close()
        if self.rt.exporter is not None:
            self.rt.exporter.close()


class SyncCounter:
    """Counts torch's sync-debug warnings ("called a synchronizing CUDA operation"): per thread, and on the decode
    (main) thread only inside `counting` windows (the hooks' own calls), with the source line of each."""

    def __init__(self) -> None:
        self.by_thread: dict[str, int] = {}
        self.sites: dict[str, int] = {}
        self.decode = 0  # main-thread syncs inside counting windows
        self.active = False
        self._show = warnings.showwarning

    def __enter__(self) -> SyncCounter:
        warnings.simplefilter("always")
        main = threading.main_thread()

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
            if SYNC_MSG not in str(message):
                return self._show(message, category, filename, lineno, file, line)
            me = threading.current_thread()
            self.by_thread[me.name] = self.by_thread.get(me.name, 0) + 1
            if me is main and self.active:
                self.decode += 1
                site = f"{os.path.relpath(filename, ROOT)}:{lineno}"
                self.sites[site] = self.sites.get(site, 0) + 1
            return None

        warnings.showwarning = show
        return self

    def __exit__(self, *exc: object) -> None:
        warnings.showwarning = self._show


@contextmanager
def counting(counter: SyncCounter | None) -> Iterator[None]:
    """A window in which the decode thread's syncs count (nothing without a counter)."""
    if counter is None:
        yield
        return
    counter.active = True
    try:
        yield
    finally:
        counter.active = False
