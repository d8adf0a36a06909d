"""The Path-P adapter on a fake DSv4 pool with sglang's real c4 page layout (584-B KV, 132-B index-K, 64-entry
pages): admission, per-layer stores, a Level-1 cycle, Level-2 picks and reserve bytes."""

import types

import pytest
import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload import OffloadLayout, check_invariants
from flashmemory.residency.level2 import Level2
from flashmemory.retriever import save_retriever
from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.sglang.decode import copy_adapter
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.geometry import PoolGeometryError, c4_counts, read_chunk_rows
from flashmemory.sglang.decode.resident_topk import apply_resident_mask, pool_locs, resident_view
from flashmemory.sglang.decode.runtime import Runtime
from flashmemory.sglang.decode.tables import c4_page_table
from flashmemory.sglang.metrics.prometheus import DISK_KEYS, METRICS, MONITOR_KEYS

pytestmark = pytest.mark.sglang
N_C4, N_PAGES, PAGE = 3, 12, 256  # c4 layers, pool pages, full-KV page size (64 c4 entries)


def fake_pool(seed=0, n_c4=N_C4):
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randint(0, 256, (N_PAGES, 37440), dtype=torch.uint8, generator=g) for _ in range(n_c4)]
    ix = [torch.randint(0, 256, (N_PAGES, 64 * 132), dtype=torch.uint8, generator=g) for _ in range(n_c4)]
    for t in ix:  # finite fp32 scales so dequantized keys are usable by the retriever
        t[:, 64 * 128 :] = torch.full((N_PAGES, 64), 0.01).view(torch.uint8).reshape(N_PAGES, 256)
        t[:, : 64 * 128] &= 0x77  # no NaN fp8 patterns
    c4 = types.SimpleNamespace(kv_buffer=kv, page_size=PAGE // 4)
    ixp = types.SimpleNamespace(index_k_with_scale_buffer=ix, page_size=PAGE // 4, index_head_dim=128)
    mapping = [(0, 0, None)] + [(4, i, c4) for i in range(n_c4)]
    return types.SimpleNamespace(c4_kv_pool=c4, c4_indexer_kv_pool=ixp, page_size=PAGE, layer_mapping=mapping)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    m = JointRetriever((1,), RetrieverDims(hidden=16, rank=8, n_heads=2, head_dim=128, rope_dim=64))
    return str(save_retriever(m, tmp_path_factory.mktemp("ck") / "tiny.safetensors"))


def env(ckpt="", **kw):
    base = dict(
        decode_swap_p=True,
        retriever_ckpt=ckpt,
        retriever_layers=(1,),
        interval=2,
        page_kmax=2,
        reserve_pages=4,
        decode_resident_chunks=64,
        decode_max_conc=2,
        last_keep=64,
        async_recall=False,
        target_context=4 * 64 * N_PAGES,
    )
    base.update(kw)
    return FlashMemoryEnv(**base)


def write_chunk(pool, loc, seed):
    """What sglang's store kernels do: new bytes for pool loc `loc` in every c4 layer (KV and index-K)."""
    g = torch.Generator().manual_seed(seed)
    lay = OffloadLayout(n_layers=N_C4, target_layers=(1,))
    for l in range(N_C4):
        lay.kv.write_chunks(
            pool.c4_kv_pool.kv_buffer[l],
            torch.tensor([loc // 64]),
            torch.tensor([loc % 64]),
            torch.randint(0, 256, (1, 584), dtype=torch.uint8, generator=g),
        )


def test_geometry_errors_name_the_buffer():
    p = fake_pool()
    p.c4_kv_pool.kv_buffer[1] = torch.zeros(N_PAGES, 37376, dtype=torch.uint8)
    with pytest.raises(PoolGeometryError, match=r"kv_buffer\[1\].*37440"):
        build(p, env())
    with pytest.raises(PoolGeometryError, match="c4_kv_pool"):
        build(types.SimpleNamespace(), env())
    with pytest.raises(PoolGeometryError, match="layers"):
        build(fake_pool(), env(retriever_layers=(5,)))


def test_prefill_decode_level1_level2(ckpt):
    pool = fake_pool()
    eng = build(pool, env(ckpt))
    assert eng.geo.n_c4_layers == N_C4 and eng.geo.page_chunks == 64 and eng.l1.scorer.__class__.__name__ != "AllPass"
    pages = [5, 2, 9, 7]  # pool pages of request "a", logical order
    r2t = torch.full((2, 4 * PAGE), -1, dtype=torch.int64)
    r2t[1] = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
    seq = 3 * PAGE + 40  # tokens before the first decode step
    lay = eng.layout
    for step in range(8):
        s = torch.tensor([seq + 1 + step])
        table = c4_page_table(r2t, torch.tensor([1]), s, PAGE)
        assert table[0].tolist() == pages
        before, after = c4_counts(s)
        if after > before:  # sglang closes a chunk this step: layer by layer
            loc = pages[int(before) // 64] * 64 + int(before) % 64
            write_chunk(pool, loc, seed=step)
        rows = eng.begin_step(["a"], table, s)
        if after > before:
            for l in range(N_C4):
                eng.on_c4_store(l, torch.tensor([loc]))
            cell = eng.cells_of(torch.tensor([[loc]]))
            assert cell.item() >= 0  # the new chunk is resident at once (decode region)
            got = lay.kv.read_chunks(eng.engine.reserve.kv, cell.reshape(1) // 64, cell.reshape(1) % 64)
            assert torch.equal(got, read_chunk_rows(lay.kv, pool.c4_kv_pool.kv_buffer, torch.tensor([loc])))
        snap = {"hidden_1": torch.randn(1, 16), "positions": s - 1}
        eng.level1(snap)
    assert rows.tolist() == [0] and eng.engine.n_chunks(0) == (seq + 8) // 4
    assert check_invariants(eng.engine) == []
    n = eng.engine.n_chunks(0)
    res_pages = eng.resident_pages(rows)[0]
    assert (res_pages >= 0).sum() >= 2  # recalled pages (Level 1) + the decode page
    # mirror == pool for the whole history (per-layer stores + next-step settle)
    locs = pool_locs(table, n)[0]
    m = eng.loc2m[locs]
    assert torch.equal(
        lay.kv.read_chunks(eng.engine.mirror.kv, m // 64, m % 64),
        read_chunk_rows(lay.kv, pool.c4_kv_pool.kv_buffer, locs),
    )
    # Level 2, mask mode: every surviving pick maps to a cell holding the mirror's (= pool's) bytes
    logits = torch.randn(1, n)
    apply_resident_mask(logits, table, eng.resident_mask)
    top = logits.topk(128, dim=1)
    picks = pool_locs(table, n)[0][top.indices[0][torch.isfinite(top.values[0])]]
    cells = eng.cells_of(picks.view(1, -1))[0].long()
    assert picks.numel() > 0 and (cells >= 0).all()
    assert torch.equal(
        lay.kv.read_chunks(eng.engine.reserve.kv, cells // 64, cells % 64),
        read_chunk_rows(lay.kv, pool.c4_kv_pool.kv_buffer, picks),
    )
    assert int(torch.isfinite(logits).sum()) == int(eng.resident_mask[pool_locs(table, n)[0]].sum())
    # Level 2, score-resident mode: the view's columns are exactly resident chunks
    vt, vl = resident_view(table, torch.tensor([n]), res_pages.view(1, -1))
    cols = (vt.long()[0].repeat_interleave(64) * 64 + torch.arange(64).repeat(vt.shape[1]))[: int(vl)]
    assert (eng.cells_of(cols.view(1, -1)) >= 0).all()
    # the core's Level2 agrees on what is resident
    out = Level2(eng.engine, max_batch=eng.cfg.max_rows).mask_topk(torch.randn(1, n), rows, k=64)
    assert (out.cells[out.chunks >= 0] >= 0).all()
    st = eng.stats()
    assert (
        set(st) == set(METRICS) - set(MONITOR_KEYS) - set(DISK_KEYS)
        and st["recall_pages"] >= 1
        and 0 < st["resident_fraction"] <= 1
    )
    # request leaves the batch: finished, its locs unmapped
    eng.begin_step([], table[:0], s[:0])
    assert (eng.cells_of(locs.view(1, -1)) == -1).all() and check_invariants(eng.engine) == []
    eng.close()


def test_no_checkpoint_keeps_newest_pages():
    pool = fake_pool(1)
    eng = build(pool, env(""))
    table = torch.tensor([[3, 4, 8, 1]])
    s = torch.tensor([4 * PAGE - 3])
    rows = eng.begin_step(["b"], table, s)
    eng.level1({"positions": s - 1})
    assert eng.resident_pages(rows)[0][:2].tolist() == [2, 3]  # KMAX=2 newest pages
    eng.close()


def test_runtime_attach_pool_builds_adapter(ckpt, monkeypatch):
    rt = Runtime()
    rt.configure(env(ckpt), ("level2", "mask", "path_p", "level1"))
    rt.attach_pool(fake_pool())
    assert isinstance(rt.engine, copy_adapter.CopyAdapter)
    rt.engine.close()


def test_a_reserve_larger_than_the_device_is_refused_before_allocation(monkeypatch) -> None:
    from flashmemory.sglang.decode import geometry
    from flashmemory.sglang.decode.adapter_factory import build
    from flashmemory.sglang.decode.geometry import PoolGeometryError, read_geometry, reserve_bytes

    pool, e = fake_pool(), env(reserve_pages=1 << 24, decode_max_conc=1 << 16)
    geo = read_geometry(pool)
    need = reserve_bytes(e, geo, 0)
    assert need == ((1 << 24) + (1 << 16) * 1 + 1) * N_C4 * 37440  # ~1.8 TiB: far past any device
    monkeypatch.setattr(geometry, "device_free_bytes", lambda dev: 64 << 30)
    allocated = []
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocated.append(a) or pytest.fail("allocated"))
    with pytest.raises(
        PoolGeometryError,
        match=r"reserve needs \d+\.\d GiB but the device has 64\.0 GiB free.*"
        r"SGLANG_PATHP_RESERVE_PAGES.*SGLANG_PATHP_DECODE_MAX_CONC",
    ):
        build(pool, e)
    assert allocated == []


def test_a_request_longer_than_the_target_context_is_served():
    """SGLANG_DSV4_TARGET_CONTEXT sizes the reserve, not a row: sglang admits up to its --context-length, and a
    row capped by the target context raised OffloadCapacityError inside the scheduler (bench serve, live)."""
    pool = fake_pool(2)
    eng = build(pool, env("", target_context=256))  # 64 c4 chunks: one page
    table = torch.tensor([[3, 4, 8, 1]])
    rows = eng.begin_step(["long"], table, torch.tensor([3 * PAGE + 9]))  # four pages of history
    for step in range(1, 4):
        rows = eng.begin_step(["long"], table, torch.tensor([3 * PAGE + 9 + 4 * step]))
    assert eng.engine.n_chunks(int(rows[0])) == (3 * PAGE + 9 + 12) // 4
    eng.close()


def test_serving_allocates_no_core_level2(monkeypatch) -> None:
    """Serving reads residency through `cells_of` / `resident_pages` and sglang's own top-k; a core `Level2`
    ([max_rows, max_chunks] + [max_rows, reserve cells] fp32 on the pool's device) would be memory nothing reads."""
    made = []
    monkeypatch.setattr(Level2, "__init__", lambda self, *a, **k: made.append(a))
    eng = build(fake_pool(), env(), shrink=False)
    eng.close()
    assert made == []
