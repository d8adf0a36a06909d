"""Shrink mode on sglang's real `DeepSeekV4TokenToKVPool`, built on CPU: no full-size device c4 KV pool, PD
transfer regions in the host mirror, stores through sglang's HiSparse translation seam, settle into the mirror."""

import inspect
import json
import os
import sys
import types

import pytest
import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.offload import check_invariants
from flashmemory.sglang.decode import hooks, shrink_hooks
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.context import ForwardContext
from flashmemory.sglang.decode.geometry import c4_counts, shrunk_kv_pages
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.decode.shrink_adapter import (
    LandingOverflowError,
    ShrinkAdapter,
    landing_chunks,
    shrink_blockers,
)

pytestmark = pytest.mark.sglang
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PAGE = 256
C4_TOKENS = 32768  # c4 entries of the pool: 516 pages of 64 (64 MB of c4 KV per layer at most)


@pytest.fixture(scope="module")
def sa(tmp_path_factory):
    """sglang server args of a PD decode server (V4-Flash-shaped tiny config), published in this process."""
    pytest.importorskip("sglang")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_check
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_text(json.dumps(gpu_check.tiny_config()))
    kw = gpu_check.engine_kwargs(str(d), 30000, pd=True)  # gpu_check's PD cases (fake transfer) ...
    kw.update(device="cpu", disaggregation_transfer_backend="nixl")  # ... as a NIXL decode server
    ctx = get_context()
    saved = (ctx._server_args, ctx._config_bags)
    args = ServerArgs(**kw)
    ctx.set_server_args(args)
    yield types.SimpleNamespace(args=args, ratios=gpu_check.tiny_config()["compress_ratios"], kw=kw, cls=ServerArgs)
    ctx._server_args, ctx._config_bags = saved


def env(**kw):
    base = dict(
        decode_swap_p=True,
        index_k_offload=True,
        retriever_layers=(1,),
        interval=2,
        page_kmax=2,
        reserve_pages=4,
        decode_resident_chunks=64,
        decode_max_conc=2,
        last_keep=64,
        async_recall=False,
        target_context=4 * C4_TOKENS,
    )
    base.update(kw)
    return FlashMemoryEnv(**base)


def make_pool(sa, monkeypatch, shrink: bool):
    """sglang's pool, built with our allocation hooks wrapped around its own methods (as HookRegistry would)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool as P

    monkeypatch.setattr(RUNTIME, "features", ("level2", "path_p", "shrink", "path_i"))
    monkeypatch.setattr(RUNTIME, "env", env())
    monkeypatch.setattr(RUNTIME, "_shrink", shrink)
    for name, hook in (
        ("_init_compressed_pools", shrink_hooks.around_init_compressed_pools),
        ("_make_kv_pool", shrink_hooks.around_make_kv_pool),
    ):
        orig = getattr(P, name)
        monkeypatch.setattr(P, name, lambda self, *a, _o=orig, _h=hook, **k: _h(_o, self, *a, **k))
    return P(
        max_num_reqs=4,
        swa_size=4096,
        c4_size=C4_TOKENS,
        c128_size=C4_TOKENS // 32,
        c4_state_pool_size=64,
        c128_state_pool_size=64,
        page_size=PAGE,
        swa_page_size=PAGE,
        dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        indexer_head_dim=128,
        layer_num=len(sa.ratios),
        device="cpu",
        enable_memory_saver=False,
        compression_ratios=sa.ratios,
    )


def c4_layer_ids(pool):
    return [i for i, m in enumerate(pool.layer_mapping) if m.compress_ratio == 4]


def test_blockers_from_sglang_server_args(sa):
    assert shrink_blockers(sa.args) == []
    assert shrink_blockers(sa.cls(**{**sa.kw, "disaggregation_transfer_backend": "fake"})) == []  # gpu_check dshrink
    assert landing_chunks(sa.args) >= 16384 // 4
    for over, why in (
        (dict(disaggregation_mode="null"), "not 'decode'"),
        (dict(disaggregation_transfer_backend="mooncake"), "needs 'nixl'"),
        (dict(enable_mixed_chunk=True), "mixed"),
        (dict(enable_hierarchical_cache=True), "hierarchical"),
        (dict(disaggregation_decode_enable_radix_cache=True), "radix"),
    ):
        args = sa.cls(**{**sa.kw, **over})  # sglang's own parser, not a stand-in
        assert any(why in b for b in shrink_blockers(args)), (over, shrink_blockers(args))
    assert shrink_blockers(None) == ["sglang server args are unknown"]


def test_compressor_stores_at_core_metadata_out_loc():
    """compressor_v2's c4 KV compressor stores at `_get_out_loc(ratio)` = `core_metadata.c4_out_loc`, translated
    only by a pool with the HiSparse seam, and its callers use the `forward_core_compressor` alias: shrink mode's
    `around_compress` row relies on exactly that (upstream drift must fail here)."""
    pytest.importorskip("sglang")
    from sglang.srt.layers.attention.dsv4 import compressor_v2

    src = inspect.getsource(compressor_v2)
    assert "out_loc = self._get_out_loc(compressor.ratio)" in src
    assert 'attr_name = f"c{compress_ratio}_out_loc"' in src
    assert 'hasattr(compress_kv_pool, "translate_loc_to_hisparse_device")' in src
    mixin = compressor_v2.CompressorBackendMixin
    assert mixin.__dict__["forward_core_compressor"] is mixin.__dict__["forward_unified"]
    from flashmemory.sglang.plumbing.targets import SPECS

    rows = {(r.target.rsplit(".", 1)[1], r.impl) for r in SPECS if r.feature == "shrink" and r.kind == "around"}
    assert ("forward_core_compressor", "flashmemory.sglang.decode.shrink_hooks:around_compress") in rows


def _stores_at(pool, eng, layer_id, out_loc, monkeypatch, in_indexer=False):
    """The locs sglang's compressor of `layer_id` stores at for pool locs out_loc [T], called through the shrink
    rows' `shrink_hooks.around_compress` (as `forward_core_compressor` is); checks the swap is undone afterwards."""
    monkeypatch.setattr(RUNTIME, "engine", eng)
    monkeypatch.setattr(RUNTIME, "pool", pool)
    monkeypatch.setattr(RUNTIME, "fwd", ForwardContext())
    cm = types.SimpleNamespace(c4_out_loc=out_loc)
    backend = types.SimpleNamespace(token_to_kv_pool=pool, forward_metadata=types.SimpleNamespace(core_metadata=cm))
    fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    comp = types.SimpleNamespace(is_in_indexer=in_indexer, ratio=4)
    seen = []
    shrink_hooks.around_compress(
        lambda self, *a: seen.append(self.forward_metadata.core_metadata.c4_out_loc), backend, None, fb, layer_id, comp
    )
    assert cm.c4_out_loc is out_loc and len(seen) == 1
    return seen[0]


def test_only_the_shrunk_c4_pool_stores_at_reserve_cells(sa, monkeypatch):
    """No attribute of ours on sglang's pool: the store translation is the `around_compress` row, and it reaches
    exactly the c4 KV compressor of the shrunk pool (copy mode, the indexer compressor without Path-I in the
    reserve, and another adapter's pool store at their pool locs, as stock)."""
    pool = make_pool(sa, monkeypatch, shrink=True)
    eng = build(pool, env(), sa.args, shrink=True)
    assert not hasattr(pool.c4_kv_pool, "translate_loc_to_hisparse_device")
    assert not hasattr(pool.c4_kv_pool, "_translate_loc_to_hisparse_device")
    lid, locs = c4_layer_ids(pool)[0], torch.tensor([0, 5, 64 * 30 + 1])
    sink = eng.engine.reserve.sink_cell
    assert _stores_at(pool, eng, lid, locs, monkeypatch).tolist() == [sink] * 3
    assert _stores_at(pool, eng, lid, locs, monkeypatch, in_indexer=True) is locs
    other = make_pool(sa, monkeypatch, shrink=True)  # RUNTIME.pool stays `pool` (set by _stores_at)
    cells = shrink_hooks.around_compress(
        lambda self, *a: self.forward_metadata.core_metadata.c4_out_loc,
        types.SimpleNamespace(
            token_to_kv_pool=other,
            forward_metadata=types.SimpleNamespace(core_metadata=types.SimpleNamespace(c4_out_loc=locs)),
        ),
        None,
        types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_idle=lambda: False)),
        lid,
        types.SimpleNamespace(is_in_indexer=False, ratio=4),
    )
    assert cells is locs  # a pool this adapter does not own stores at its own locs
    copy_pool = make_pool(sa, monkeypatch, shrink=False)
    copy_eng = build(copy_pool, env(), None)
    assert _stores_at(copy_pool, copy_eng, lid, locs, monkeypatch) is locs


def test_allocation_and_pd_regions(sa, monkeypatch):
    pool = make_pool(sa, monkeypatch, shrink=True)
    kvp = pool.c4_kv_pool
    n_pages = pool.c4_indexer_kv_pool.index_k_with_scale_buffer[0].shape[0]
    assert shrunk_kv_pages(pool) == n_pages and all(t.shape[0] <= 5 for t in kvp.kv_buffer)
    assert not [k for k in vars(kvp) if k.startswith("flashmemory")]  # nothing of ours stored on the pool
    stock_infos = pool.get_contiguous_buf_infos()
    eng = build(pool, env(), sa.args, shrink=True)
    assert isinstance(eng, ShrinkAdapter) and eng.geo.n_pages == n_pages
    res = eng.engine.reserve
    assert all(kvp.kv_buffer[l] is not None and kvp.kv_buffer[l].data_ptr() == res.kv[l].data_ptr() for l in range(2))
    assert eng.device_bytes_saved == 2 * n_pages * 37440 - res.kv.numel() and eng.stats()["device_bytes_saved"] > 0
    # target index pool = sglang's own index-K buffer (no second device copy)
    assert eng.engine.target.pages[0].data_ptr() == pool.c4_indexer_kv_pool.index_k_with_scale_buffer[1].data_ptr()
    monkeypatch.setattr(RUNTIME, "engine", eng)
    monkeypatch.setattr(RUNTIME, "pool", pool)
    ptrs, lens, items = hooks.around_contiguous_buf_infos(type(pool).get_contiguous_buf_infos, pool)
    m = eng.engine.mirror.kv
    assert (
        ptrs[:2] == [m[0].data_ptr(), m[1].data_ptr()]
        and lens[:2] == [n_pages * 37440] * 2
        and items[:2] == [37440] * 2
    )
    assert ptrs[2:] == stock_infos[0][2:] and lens[2:] == stock_infos[1][2:]  # index-K, c128 untouched
    args = types.SimpleNamespace(kv_data_ptrs=ptrs, kv_data_mem_kinds=None)
    shrink_hooks.before_nixl_manager_init(None, args, "decode")
    assert args.kv_data_mem_kinds == ["DRAM", "DRAM"] + ["VRAM"] * (len(ptrs) - 2)


def test_copy_mode_allocates_stock(sa, monkeypatch):
    pool = make_pool(sa, monkeypatch, shrink=False)
    assert shrunk_kv_pages(pool) is None
    n = pool.c4_indexer_kv_pool.index_k_with_scale_buffer[0].shape[0]
    assert all(t.shape[0] >= n for t in pool.c4_kv_pool.kv_buffer)
    eng = build(pool, env(), None)  # no server args: copy mode, with a warning
    assert eng.mode == "copy" and eng.mirror_buf_infos() == {}
    assert not hasattr(pool.c4_kv_pool, "_translate_loc_to_hisparse_device")
    # inside attention the reserve stands in for the pool, in the pool's own dtype view (fp8, not raw uint8)
    monkeypatch.setattr(RUNTIME, "engine", eng)
    monkeypatch.setattr(RUNTIME, "pool", pool)
    monkeypatch.setattr(RUNTIME, "fwd", ForwardContext(attn_layer=1))
    lid = c4_layer_ids(pool)[1]
    stock = type(pool).get_extra_key_buffer(pool, lid)
    got = hooks.around_get_extra_key_buffer(type(pool).get_extra_key_buffer, pool, lid)
    assert stock.dtype == torch.float8_e4m3fn and got.dtype == stock.dtype
    assert got.data_ptr() == eng.engine.reserve.kv[1].data_ptr() and got.data_ptr() != stock.data_ptr()


def _rand(g, *shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def test_pd_landing_decode_stores_settle(sa, monkeypatch):
    """A request whose history arrived by PD in the mirror decodes 150 steps: sglang's store (through the seam)
    writes each new entry into its reserve cell, attention reads every resident pick with the right bytes, and
    after each forward the mirror holds the whole history."""
    pool = make_pool(sa, monkeypatch, shrink=True)
    eng = build(pool, env(), sa.args, shrink=True)
    lay, g = eng.layout, torch.Generator().manual_seed(0)
    ids = c4_layer_ids(pool)
    ix = pool.c4_indexer_kv_pool.index_k_with_scale_buffer
    pages = [9, 3, 40, 17, 22, 5]  # the request's c4 pool pages, logical order
    seq0 = 3 * PAGE + 40  # tokens transferred by P
    n0 = seq0 // 4
    truth = {}  # pool loc -> [2, 584] KV bytes
    m = eng.engine.mirror.kv
    for j in range(n0):  # PD: KV into the mirror, index-K into the device pool
        loc = pages[j // 64] * 64 + j % 64
        truth[loc] = _rand(g, 2, 584)
        lay.kv.write_chunks(m, torch.tensor([loc // 64]), torch.tensor([loc % 64]), truth[loc].unsqueeze(1))
        for l in range(2):
            lay.index.write_chunks(ix[l], torch.tensor([loc // 64]), torch.tensor([loc % 64]), _rand(g, 1, 132))
    table_full = torch.tensor([pages])
    for step in range(150):
        s = torch.tensor([seq0 + 1 + step])
        before, after = (int(x) for x in c4_counts(s))
        n_pages = -(-after // 64)
        table = table_full[:, :n_pages]
        assert eng.admission_refusals(["a"], s) == []  # the guard's admission check passes in shrink mode
        rows = eng.begin_step(["a"], table, s)
        out_loc = torch.tensor([pages[before // 64] * 64 + before % 64 if after > before else 0])
        for l in range(2):  # compressor_v2: kv_cache[translate(out_loc)] = entry
            cells = _stores_at(pool, eng, ids[l], out_loc, monkeypatch)
            buf = pool.get_extra_key_buffer(ids[l]).view(torch.uint8)  # as compressor_v2 does
            entry = _rand(g, 1, 584)
            lay.kv.write_chunks(buf, cells // 64, cells % 64, entry)
            lay.index.write_chunks(ix[l], out_loc // 64, out_loc % 64, _rand(g, 1, 132))
            if after > before:
                truth.setdefault(int(out_loc), torch.zeros(2, 584, dtype=torch.uint8))[l] = entry[0]
        # attention: every resident history loc reads its true bytes from get_extra_key_buffer (the reserve)
        locs = torch.tensor(sorted(truth))
        cells = eng.cells_of(locs.view(1, -1))[0].long()
        res = cells >= 0
        if after > before:
            assert bool(res[locs == int(out_loc)].all())  # the newest entry is resident (its decode page)
        for l in range(2 if bool(res.any()) else 0):
            got = lay.kv.read_chunks(
                pool.get_extra_key_buffer(ids[l]).view(torch.uint8), cells[res] // 64, cells[res] % 64
            )
            want = torch.stack([truth[int(x)][l] for x in locs[res]])
            assert torch.equal(got, want), (step, l)
        RUNTIME_after(eng)
        eng.level1({})
    assert rows.tolist() == [0] and eng.engine.n_chunks(0) == (seq0 + 150) // 4
    locs = torch.tensor(sorted(truth))
    assert torch.equal(lay.kv.read_chunks(m, locs // 64, locs % 64), torch.stack([truth[int(x)] for x in locs], 1))
    assert check_invariants(eng.engine) == []
    assert eng.stats()["level1_cycles"] > 0
    eng.begin_step([], torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert eng.engine.mirror.free_pages == eng.engine.mirror.n_pages  # pages go back on finish
    eng.close()


def RUNTIME_after(eng):
    eng.settle()


def test_unknown_locs_go_to_the_sink(sa, monkeypatch):
    pool = make_pool(sa, monkeypatch, shrink=True)
    eng = build(pool, env(), sa.args, shrink=True)
    sink = eng.engine.reserve.sink_cell
    out = _stores_at(pool, eng, c4_layer_ids(pool)[0], torch.tensor([0, 5, 64 * 30 + 1, -1, 10**6]), monkeypatch)
    assert out.tolist() == [sink] * 5


def test_extend_lands_then_moves_to_the_mirror(sa, monkeypatch):
    pool = make_pool(sa, monkeypatch, shrink=True)
    eng = build(pool, env(), sa.args, shrink=True)
    lay, g = eng.layout, torch.Generator().manual_seed(1)
    ids = c4_layer_ids(pool)
    eng.begin_forward(False)
    # one extend forward, 2 requests, 40 + 24 tokens: out_loc per token, c4 loc on boundaries, else 0
    out_loc = torch.zeros(64, dtype=torch.int64)
    out_loc[3:40:4] = torch.arange(10) + 7 * 64
    out_loc[43:64:4] = torch.arange(6) + 12 * 64 + 30
    want = {}
    for l in range(2):
        cells = _stores_at(pool, eng, ids[l], out_loc, monkeypatch)
        assert ((cells == eng.engine.reserve.sink_cell) == (out_loc == 0)).all()
        rows = _rand(g, int((out_loc > 0).sum()), 584)
        lay.kv.write_chunks(
            pool.get_extra_key_buffer(ids[l]).view(torch.uint8), cells[out_loc > 0] // 64, cells[out_loc > 0] % 64, rows
        )
        want[l] = rows
    eng.end_extend()
    locs = out_loc[out_loc > 0]
    for l in range(2):
        assert torch.equal(lay.kv.read_chunks(eng.engine.mirror.kv[l], locs // 64, locs % 64), want[l])
    assert eng.phase == "decode"
    eng.begin_forward(False)
    too_many = torch.arange(1, eng.engine.reserve.landing_blocks * 64 + 2)
    with pytest.raises(LandingOverflowError, match="max-prefill-tokens"):
        eng.store_cells(too_many)  # through the hook the guard stops the server on it (state in doubt)


def test_credit_hook_drops_only_the_c4_kv_term(monkeypatch):
    cfg = types.SimpleNamespace(c4_shrink_factor=1, _get_paged_kv_bytes_per_token=lambda r: 585.0)
    orig = lambda self, ratio: {4: 585.0 / 4 + 132 / 4, 128: 585.0 / 128}[ratio]  # noqa: E731
    monkeypatch.setattr(RUNTIME, "_shrink", True)
    assert shrink_hooks.around_c4_bytes_per_token(orig, cfg, 4) == pytest.approx(33.0)
    assert shrink_hooks.around_c4_bytes_per_token(orig, cfg, 128) == pytest.approx(585.0 / 128)
    monkeypatch.setattr(RUNTIME, "_shrink", False)
    assert shrink_hooks.around_c4_bytes_per_token(orig, cfg, 4) == pytest.approx(585.0 / 4 + 33.0)


def test_runtime_routes_forward_phases(sa, monkeypatch, caplog):
    """before_forward sets where stores land; a real extend on a shrink server is counted and logged once;
    after an extend forward the landing moves to the mirror."""
    from flashmemory.sglang.decode.runtime import Runtime

    pool = make_pool(sa, monkeypatch, shrink=True)
    rt = Runtime()
    rt.engine = build(pool, env(), sa.args, shrink=True)

    def batch(decode, rids):
        mode = types.SimpleNamespace(is_decode=lambda: decode, is_idle=lambda: False)
        return types.SimpleNamespace(forward_mode=mode, rids=rids)

    rt.before_forward(batch(False, []))  # a warmup-style extend without requests
    assert rt.engine.phase == "extend" and "shrink_extend_forwards" not in rt.counters
    rt.after_extend_forward()
    assert rt.engine.phase == "decode"
    for _ in range(2):
        rt.before_forward(batch(False, ["r1"]))
    assert rt.counters["shrink_extend_forwards"] == 2 and caplog.text.count("may be wrong") == 1
    rt.before_forward(batch(True, ["r1"]))  # decode without req_to_token: phase only
    assert rt.engine.phase == "decode"


def test_build_refuses_a_mirror_the_host_cannot_hold(sa, monkeypatch):
    from flashmemory.offload import mirror

    pool = make_pool(sa, monkeypatch, shrink=True)
    need = 2 * pool.c4_indexer_kv_pool.index_k_with_scale_buffer[0].shape[0] * 37440  # 2 c4 layers, no Path-I
    monkeypatch.setattr(mirror, "host_available_bytes", lambda meminfo="": int(need * 8 / 0.9) - 1)
    with pytest.raises(mirror.OffloadCapacityError, match="x 8 local rank"):
        build(pool, env(index_k_offload=False), types.SimpleNamespace(tp_size=8, nnodes=1), shrink=True)
    build(pool, env(index_k_offload=False), types.SimpleNamespace(tp_size=4, nnodes=1), shrink=True)
