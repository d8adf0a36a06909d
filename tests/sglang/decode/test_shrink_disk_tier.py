"""Shrink mode (PD decode) with the disk tier, on sglang's real `DeepSeekV4TokenToKVPool` built on CPU, no server.

PD lands each request's c4 KV where NIXL writes it (`mirror_buf_infos`: the mirror at pool page id x page bytes),
then the requests decode through sglang's store seam as `test_shrink` does, with a host page cache of one page and
KMAX 2, so sealed pages go to the store and Level 1 reads them back from disk. Checked every step: each resident
pick reads its true bytes through sglang's c4 buffer (the reserve). And: the mirror is a `SparseMirror` whose
DRAM (mincore) falls once pages are sealed, a sealed page is never read from the mirror, and the faults (read
error, checksum mismatch, full disk, deleted store) fail only the request they hit or lose nothing.
"""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

from flashmemory.env import DiskTierConfig
from flashmemory.offload import RecallRequest, check_invariants
from flashmemory.offload.disk import FaultyFileOps
from flashmemory.offload.disk.format import unpack_rows
from flashmemory.offload.disk.sparse_mirror import OS_PAGE, SparseMirror, resident_bytes
from flashmemory.offload.mirror import RELEASED, ReleasedPageError
from flashmemory.offload.tiered_mirror import TieredEngine
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.geometry import c4_counts
from flashmemory.sglang.decode.guard import RequestFailure
from tests.sglang.decode import test_shrink_adapter
from tests.sglang.decode.test_shrink_adapter import PAGE, _rand, c4_layer_ids, env, make_pool

pytestmark = pytest.mark.sglang
sa = test_shrink_adapter.sa  # the PD decode server's sglang args (a module fixture)
CACHE_GB = 0.0001  # 100 KB: one disk page of this pool (2 c4 layers x 37,376 B + 1 Path-I layer x 8,448 B)


class PdDecode:
    """The shrink adapter with the tier; `land` writes a request's KV as the PD transfer does, `step` runs one
    decode step for the given requests (sglang's stores through the seam, settle, Level 1) and checks every
    resident pick's bytes in the c4 buffer attention reads."""

    def __init__(self, sa, monkeypatch, tmp_path, mirror_gb: float = 0.0, **kw):
        self.pool = make_pool(sa, monkeypatch, shrink=True)
        disk = DiskTierConfig(dir=str(tmp_path), disk_gb=0.01, host_cache_gb=CACHE_GB, host_mirror_gb=mirror_gb)
        self.ad = build(self.pool, env(disk=disk, **kw), sa.args, shrink=True)
        self.ad.make_failure = RequestFailure  # what hooks.after_pool_init hands the adapter
        self.lay, self.g, self.ids = self.ad.layout, torch.Generator().manual_seed(0), c4_layer_ids(self.pool)
        self.truth: dict[int, torch.Tensor] = {}  # pool loc -> [2, 584] KV bytes of both c4 layers
        self.reqs: dict[str, tuple[list[int], int]] = {}  # rid -> (pool pages, tokens)

    @property
    def engine(self) -> TieredEngine:
        return self.ad.engine

    def land(self, rid: str, pages: list[int], tokens: int) -> None:
        """P's transfer: KV at the host address NIXL computes from `mirror_buf_infos`, index-K in the pool."""
        infos = self.ad.mirror_buf_infos()
        ix = self.pool.c4_indexer_kv_pool.index_k_with_scale_buffer
        kv = self.pool.c4_kv_pool.kv_buffer
        for j in range(tokens // 4):
            loc = pages[j // 64] * 64 + j % 64
            self.truth[loc] = _rand(self.g, 2, 584)
            for l in range(2):
                base, _n, page_bytes = infos[kv[l].data_ptr()]
                page = torch.frombuffer(_host_view(base + (loc // 64) * page_bytes, page_bytes), dtype=torch.uint8)
                self.lay.kv.write_chunks(
                    page.view(1, -1), torch.tensor([0]), torch.tensor([loc % 64]), self.truth[loc][l].view(1, -1)
                )  # at the raw address the transfer uses
                self.lay.index.write_chunks(
                    ix[l], torch.tensor([loc // 64]), torch.tensor([loc % 64]), _rand(self.g, 1, 132)
                )
        self.reqs[rid] = (pages, tokens)

    def step(self, rids: list[str], level1: bool = True) -> None:
        seq = torch.tensor([self.reqs[r][1] + 1 for r in rids])
        before, after = c4_counts(seq)
        width = max(-(-int(a) // 64) for a in after)
        table = torch.tensor([(self.reqs[r][0] + [0] * width)[:width] for r in rids])
        self.ad.begin_step(rids, table, seq)
        self.batch = list(rids)  # batch row i picks for rids[i] (cells_of resolves each row's own pages)
        out = torch.tensor(
            [self.reqs[r][0][int(b) // 64] * 64 + int(b) % 64 if a > b else 0 for r, b, a in zip(rids, before, after)]
        )
        ix = self.pool.c4_indexer_kv_pool.index_k_with_scale_buffer
        for l in range(2):  # compressor_v2: kv_cache[translate(out_loc)] = entry
            cells = self.ad.store_cells(out)  # what the shrink row hands sglang's c4 KV compressor
            buf = self.pool.get_extra_key_buffer(self.ids[l]).view(torch.uint8)
            entries = _rand(self.g, len(rids), 584)
            self.lay.kv.write_chunks(buf, cells // 64, cells % 64, entries)
            self.lay.index.write_chunks(ix[l], out // 64, out % 64, _rand(self.g, len(rids), 132))
            for i in range(len(rids)):
                if after[i] > before[i]:
                    self.truth.setdefault(int(out[i]), torch.zeros(2, 584, dtype=torch.uint8))[l] = entries[i]
        self.check_resident(rids)
        for r in rids:
            self.reqs[r] = (self.reqs[r][0], self.reqs[r][1] + 1)
        self.ad.settle()
        if level1:
            self.ad.level1({})

    def recall(self, rid: str, page: int) -> None:
        """Hold `page` of `rid` in place of one of its resident pages (budget 1): Level 1 (which keeps the newest
        pages without a retriever) recalls the displaced one at its next cycle, from the tier once it is sealed."""
        e, row = self.engine, self.ad.rows[rid]
        e.recaller.recall([RecallRequest(row, e.gen(row), (page,), (1.0,), budget=1)])

    def locs(self, rids: list[str]) -> torch.Tensor:
        out = []
        for r in rids:
            pages, tokens = self.reqs[r]
            out += [pages[j // 64] * 64 + j % 64 for j in range(-(-(tokens + 1) // 4))]
        return torch.tensor(sorted(x for x in out if x in self.truth))

    def check_resident(self, rids: list[str]) -> int:
        """Every resident loc of these requests reads its true bytes in both c4 buffers; returns how many. Each
        request's locs are asked on its own row of the last step's batch, as its top-k picks are."""
        per = {r: self.locs([r]) for r in rids}
        width = max(1, max(int(x.numel()) for x in per.values()))
        table = torch.full((len(self.batch), width), -1, dtype=torch.int64)
        for r, x in per.items():
            table[self.batch.index(r), : x.numel()] = x
        cells_all = self.ad.cells_of(table).long()
        locs = torch.cat([per[r] for r in rids])
        cells = torch.cat([cells_all[self.batch.index(r), : per[r].numel()] for r in rids])
        res = cells >= 0
        for l in range(2):
            got = self.lay.kv.read_chunks(
                self.pool.get_extra_key_buffer(self.ids[l]).view(torch.uint8), cells[res] // 64, cells[res] % 64
            )
            assert torch.equal(got, torch.stack([self.truth[int(x)][l] for x in locs[res]])), l
        return int(res.sum())

    def check_held(self, rid: str) -> int:
        """The tier's bytes of every sealed page of `rid` equal what P sent / decode stored; returns the pages."""
        e, row = self.engine, self.ad.rows[rid]
        pages, _ = self.reqs[rid]
        sealed = e.sealed[row][1]
        for p in range(sealed):
            kv, _ix = unpack_rows(e.held_page(row, p), e.layout)  # [layers, page bytes]
            got = e.layout.kv.read_chunks(kv.unsqueeze(1), torch.zeros(64, dtype=torch.int64), torch.arange(64))
            want = torch.stack([self.truth[pages[p] * 64 + c] for c in range(64)], 1)
            assert torch.equal(got, want), (rid, p)
        return sealed


def _host_view(addr: int, n: int) -> ctypes.Array:
    """n writable host bytes at a raw address (where a transfer engine writes)."""
    return (ctypes.c_ubyte * n).from_address(addr)


def test_pd_history_beyond_the_host_cache_decodes_exact_from_disk(sa, monkeypatch, tmp_path):
    pd = PdDecode(sa, monkeypatch, tmp_path)
    e = pd.engine
    try:
        assert isinstance(e, TieredEngine) and isinstance(e.mirror, SparseMirror)
        kv_ptr = pd.pool.c4_kv_pool.kv_buffer[0].data_ptr()
        assert pd.ad.mirror_buf_infos()[kv_ptr][0] == e.mirror.kv[0].data_ptr()  # NIXL lands in the sparse mirror
        idle = resident_bytes(e.mirror.kv)
        pd.land("a", [9, 3, 40, 17, 22, 5, 30], 5 * PAGE + 200)  # 370 c4 entries: 6 pages, 5 complete
        pd.land("b", [11, 2, 50, 7, 31, 6, 18], 4 * PAGE + 12)
        landed = resident_bytes(e.mirror.kv)
        page_kv = e.layout.n_layers * e.layout.kv_page_bytes
        assert landed - idle >= 9 * page_kv, (idle, landed)  # P's bytes took DRAM
        for k in range(70):  # a's page 5 fills (384) and is sealed
            if k % 3 == 2:
                pd.recall("a", k % 4)
                pd.recall("b", k % 3)
            pd.step(["a", "b"])
        st = pd.ad.stats()
        assert st["disk_bytes_written"] > 0 and st["disk_bytes_read"] > 0 and st["disk_cache_misses"] > 0, st
        assert st["disk_corrupt_pages"] == 0 and st["disk_write_errors"] == 0
        assert pd.check_held("a") >= 6 and pd.check_held("b") >= 4
        # DRAM: each request's open tail page, and the OS pages a released page shares with a page that is not
        # released (free here: a transfer may land there), hold bytes; every sealed page's own OS pages went back
        released = int((e.mirror.slot_of == RELEASED).sum())
        assert e.mirror.slots_in_use == 2 and released >= 10 and e.mirror.dropped_bytes > 0
        lay, now = e.layout, resident_bytes(e.mirror.kv) - idle
        assert now <= 2 * lay.n_layers * (lay.kv_page_bytes + 2 * OS_PAGE) + 2 * OS_PAGE * lay.n_layers * released
        assert now < (landed - idle) / 2, (idle, landed, now)
        with pytest.raises(ReleasedPageError):
            e.mirror.row(9)  # a's page 0 lives in the tier only
        assert check_invariants(e) == []
        pd.ad.begin_step([], torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        assert e.tier.store.used_slots == 0 and e.mirror.free_pages == e.mirror.n_pages
    finally:
        pd.ad.close()


def _two_sealed(sa, monkeypatch, tmp_path) -> tuple[PdDecode, FaultyFileOps]:
    """a and b landed (4 complete pages each) on an adapter whose store writes through a fault injector."""
    pd = PdDecode(sa, monkeypatch, tmp_path)
    ops = FaultyFileOps()
    pd.engine.tier.store.ops = ops
    pd.land("a", [9, 3, 40, 17, 22], 4 * PAGE + 40)
    pd.land("b", [11, 2, 50, 7, 31], 4 * PAGE + 12)
    return pd, ops


def _serve_b_on(pd: PdDecode, steps: int = 24) -> None:
    """b alone decodes on with Level 1 reading its pages back from the tier: every resident pick exact."""
    for k in range(steps):
        if k % 3 == 2:
            pd.recall("b", k % 4)
        pd.step(["b"])
    assert pd.check_held("b") >= 4 and check_invariants(pd.engine) == []


@pytest.mark.parametrize("fault", ["read_error", "checksum"])
def test_a_bad_disk_page_fails_only_its_request(sa, monkeypatch, tmp_path, fault):
    pd, ops = _two_sealed(sa, monkeypatch, tmp_path)
    try:
        pd.step(["a", "b"], level1=False)  # admitted: the newest 2 pages resident (warm start)
        pd.recall("a", 0)  # from the mirror (not sealed yet): a's page 3 leaves
        if fault == "checksum":
            ops.plan.corrupt = 4  # a's 4 pages are written behind first (sealed first): they land damaged
        pd.step(["a", "b"], level1=False)  # seals 4 pages each; all but one go to disk
        assert pd.engine.tier.settle()
        assert pd.ad.stats()["disk_bytes_written"] > 0
        if fault == "read_error":
            ops.plan.read_errors = [errno.EIO]  # the next disk read: a's page 3, the cycle's only one
        with pytest.raises(RequestFailure) as err:  # Level 1 keeps a's newest 2 pages: page 3 comes from disk
            pd.ad.level1({})
        assert err.value.rid == "a" and "page 3" in err.value.reason, err.value
        assert ("corrupt" if fault == "checksum" else "read failed") in err.value.reason
        pd.check_resident(["b"])  # b's recalls of that cycle were published, exact
        _serve_b_on(pd)
        assert pd.ad.stats()["disk_bytes_read"] > 0
    finally:
        pd.ad.close()


def test_a_full_disk_keeps_pages_in_dram_and_loses_nothing(sa, monkeypatch, tmp_path):
    pd, ops = _two_sealed(sa, monkeypatch, tmp_path)
    try:
        ops.plan.full = True  # every write behind fails with ENOSPC
        for k in range(8):
            if k % 3 == 2:
                pd.recall("a", k % 4)
            pd.step(["a", "b"])
        assert pd.engine.tier.settle() is not None
        st = pd.ad.stats()
        assert st["disk_write_errors"] > 0 and st["disk_pages_in_dram_pinned"] > 0, st
        ops.plan.full = False  # space returns: both decode on, exact
        for k in range(16):
            if k % 3 == 2:
                pd.recall("a", k % 4)
                pd.recall("b", k % 4)
            pd.step(["a", "b"])
        assert pd.check_held("a") >= 4 and pd.check_held("b") >= 4 and check_invariants(pd.engine) == []
    finally:
        pd.ad.close()


def test_a_deleted_store_loses_nothing(sa, monkeypatch, tmp_path):
    pd, _ops = _two_sealed(sa, monkeypatch, tmp_path)
    try:
        pd.step(["a", "b"])
        assert pd.engine.tier.settle()
        stores = list(tmp_path.glob("fm-pagestore-*"))
        assert len(stores) == 1
        os.unlink(stores[0])  # removed under the engine: the open file lives on
        for k in range(24):
            if k % 3 == 2:
                pd.recall("a", k % 4)
                pd.recall("b", k % 4)
            pd.step(["a", "b"])
        st = pd.ad.stats()
        assert st["disk_bytes_read"] > 0 and st["disk_corrupt_pages"] == 0, st
        assert pd.check_held("a") >= 4 and pd.check_held("b") >= 4 and check_invariants(pd.engine) == []
    finally:
        pd.ad.close()
