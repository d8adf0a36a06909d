"""Shrink mode with Path-I on sglang's real pool (CPU): the non-target index-K in the reserve, read through a
reserve-block view; and the in-graph shrink paths make no host sync."""

import types

import pytest
import torch

from flashmemory.offload import check_invariants
from flashmemory.sglang.decode import hooks, shrink_hooks
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.context import ForwardContext
from flashmemory.sglang.decode.geometry import c4_counts
from flashmemory.sglang.decode.runtime import RUNTIME
from tests.sglang.decode.test_shrink_adapter import PAGE, _rand, c4_layer_ids, env, make_pool, sa  # noqa: F401  (sa: fixture)

pytestmark = pytest.mark.sglang


def _index_rows(g, n):
    """n index-K chunk rows (128 fp8 without NaN patterns | fp32 scale in [0.5, 1.5))."""
    fp8 = torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g) & 0x77
    scale = (torch.rand(n, 1, generator=g) + 0.5).view(torch.uint8)
    return torch.cat([fp8, scale], dim=1)


def test_path_i_index_in_the_reserve(sa, monkeypatch):
    """Path-I + score-resident in shrink mode: the non-target index-K pool is the Path-I reserve, PD lands it in
    the mirror, the indexer store goes through `around_compress`, and the reserve-block view scores exactly what
    the full pool would over the resident columns, its picks being cells whose KV is the true KV."""
    from dataclasses import dataclass

    from flashmemory.sglang.decode.resident_topk import paged_index_scores
    from flashmemory.sglang.decode.tables import Level2Buffers

    @dataclass
    class MD:
        page_table: torch.Tensor
        compressed_seq_lens: torch.Tensor

    pool = make_pool(sa, monkeypatch, shrink=True)
    e = env(score_resident=True)
    monkeypatch.setattr(RUNTIME, "env", e)
    eng = build(pool, e, sa.args, shrink=True)
    assert eng.index_shrink and eng.layout.offload_index_layers == (0,)
    monkeypatch.setattr(RUNTIME, "engine", eng)
    monkeypatch.setattr(RUNTIME, "pool", pool)
    monkeypatch.setattr(RUNTIME, "bufs", Level2Buffers.allocate(2, RUNTIME.level2_width(), "cpu"))
    monkeypatch.setattr(RUNTIME, "fwd", ForwardContext())
    lay, g, ids = eng.layout, torch.Generator().manual_seed(2), c4_layer_ids(pool)
    ix = pool.c4_indexer_kv_pool.index_k_with_scale_buffer
    res = eng.engine.reserve
    assert ix[0].data_ptr() == res.index[0].data_ptr() and ix[1].shape[0] >= eng.geo.n_pages
    infos = hooks.around_contiguous_buf_infos(type(pool).get_contiguous_buf_infos, pool)
    args = types.SimpleNamespace(kv_data_ptrs=infos[0], kv_data_mem_kinds=None)
    shrink_hooks.before_nixl_manager_init(None, args, "decode")
    assert args.kv_data_mem_kinds[:3] == ["DRAM"] * 3 and infos[0][2] == eng.engine.mirror.index[0].data_ptr()
    assert infos[1][2] == eng.geo.n_pages * 8448 and args.kv_data_mem_kinds[3] == "VRAM"  # target index-K
    pages = [30, 8, 41, 2, 19, 27, 33]
    seq0 = 3 * PAGE + 100
    truth_kv = {}
    truth_ix0 = torch.zeros(eng.geo.n_pages, 8448, dtype=torch.uint8)  # what a full layer-0 index pool holds

    def put(loc, kv, ix0, ix1):
        truth_kv[loc] = kv
        r, o = torch.tensor([loc // 64]), torch.tensor([loc % 64])
        lay.index.write_chunks(truth_ix0, r, o, ix0)
        lay.index.write_chunks(ix[1], r, o, ix1)  # target layer: sglang's own pool

    for j in range(seq0 // 4):  # PD: KV + Path-I index into the mirror
        loc = pages[j // 64] * 64 + j % 64
        put(loc, _rand(g, 2, 584), _index_rows(g, 1), _index_rows(g, 1))
        r, o = torch.tensor([loc // 64]), torch.tensor([loc % 64])
        lay.kv.write_chunks(eng.engine.mirror.kv, r, o, truth_kv[loc].unsqueeze(1))
        lay.index.write_chunks(eng.engine.mirror.index[0], r, o, lay.index.read_chunks(truth_ix0, r, o))
    backend = types.SimpleNamespace(
        token_to_kv_pool=pool,
        forward_metadata=types.SimpleNamespace(core_metadata=types.SimpleNamespace(c4_out_loc=None)),
    )
    fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    comp = types.SimpleNamespace(is_in_indexer=True, ratio=4)
    checked = 0
    for step in range(120):
        s = torch.tensor([seq0 + 1 + step])
        before, after = (int(x) for x in c4_counts(s))
        table = torch.tensor([pages[: -(-after // 64)]])
        rows = eng.begin_step(["a"], table, s)
        new = after > before
        out_loc = torch.tensor([pages[before // 64] * 64 + before % 64 if new else 0])
        kv, ix0, ix1 = _rand(g, 2, 584), _index_rows(g, 1), _index_rows(g, 1)
        backend.forward_metadata.core_metadata.c4_out_loc = out_loc

        def indexer_store(self, x, fbatch, layer_id, compressor):  # compressor_v2: index-K at c4_out_loc
            loc = self.forward_metadata.core_metadata.c4_out_loc
            lay.index.write_chunks(
                self.token_to_kv_pool.get_index_k_with_scale_buffer(layer_id), loc // 64, loc % 64, ix0
            )

        shrink_hooks.around_compress(indexer_store, backend, x=None, forward_batch=fb, layer_id=ids[0], compressor=comp)
        assert backend.forward_metadata.core_metadata.c4_out_loc is out_loc  # restored after the call
        stored = []  # the c4 KV compressor's store locs, through the shrink row (one forward: same for each layer)
        shrink_hooks.around_compress(
            lambda self, *a: stored.append(self.forward_metadata.core_metadata.c4_out_loc),
            backend,
            None,
            fb,
            ids[0],
            types.SimpleNamespace(is_in_indexer=False, ratio=4),
        )
        for l in range(2):
            cells = stored[0]
            lay.kv.write_chunks(
                pool.get_extra_key_buffer(ids[l]).view(torch.uint8), cells // 64, cells % 64, kv[l : l + 1]
            )
        lay.index.write_chunks(ix[1], out_loc // 64, out_loc % 64, ix1)
        if new:
            put(int(out_loc), kv, ix0, ix1)
        if step % 7 == 0:  # Level 2 of layer 0, this step
            RUNTIME.bufs.sel_pages[:1] = eng.resident_pages(rows)[:, : RUNTIME.bufs.sel_pages.shape[1]]
            md = MD(table.to(torch.int32), torch.tensor([after], dtype=torch.int32))
            blocks = hooks._resident_block_metadata(md, 0)
            view = hooks._resident_metadata(md, 1)
            assert (
                torch.equal(blocks.compressed_seq_lens, view.compressed_seq_lens) and int(view.compressed_seq_lens) > 0
            )
            q, w = torch.randn(1, 4, 128, generator=g), torch.rand(1, 4, generator=g)
            got = paged_index_scores(q, w, ix[0], blocks.page_table, blocks.compressed_seq_lens)
            want = paged_index_scores(q, w, truth_ix0, view.page_table, view.compressed_seq_lens)
            n = int(view.compressed_seq_lens)
            assert torch.allclose(got[:, :n], want[:, :n], rtol=1e-5, atol=1e-5), step
            col = got[0, :n].topk(min(32, n)).indices
            cells = blocks.page_table[0, col // 64].long() * 64 + col % 64
            cells = eng.drop_sink(cells.view(1, -1))[0]
            assert (cells >= 0).all()  # every column is resident
            locs = view.page_table[0, col // 64].long() * 64 + col % 64
            for l in range(2):
                kv_got = lay.kv.read_chunks(
                    pool.get_extra_key_buffer(ids[l]).view(torch.uint8), cells // 64, cells % 64
                )
                assert torch.equal(kv_got, torch.stack([truth_kv[int(x)][l] for x in locs]))
            # the same through the indexer hook, both layers: top-k as sglang's topk_transform writes them
            for l in range(2):
                meta = types.SimpleNamespace(
                    indexer_metadata=md,
                    core_metadata=types.SimpleNamespace(
                        c4_sparse_page_indices=torch.full((1, 32), -1, dtype=torch.int32), positions=s - 1
                    ),
                )
                be = types.SimpleNamespace(token_to_kv_pool=pool, forward_metadata=meta)
                dfb = types.SimpleNamespace(
                    forward_mode=types.SimpleNamespace(is_idle=lambda: False, is_decode=lambda: True), rids=["a"]
                )

                def indexer(self, x, q_lora, c4_indexer, fbatch):
                    im = self.forward_metadata.indexer_metadata
                    buf = self.token_to_kv_pool.get_index_k_with_scale_buffer(c4_indexer.layer_id)
                    sc = paged_index_scores(q, w, buf, im.page_table, im.compressed_seq_lens)[
                        0, : int(im.compressed_seq_lens)
                    ]
                    c = sc.topk(min(32, sc.numel())).indices
                    out = self.forward_metadata.core_metadata.c4_sparse_page_indices
                    out[0, : c.numel()] = (im.page_table[0, c // 64].long() * 64 + c % 64).to(torch.int32)

                hooks.around_forward_c4_indexer(indexer, be, None, None, types.SimpleNamespace(layer_id=ids[l]), dfb)
                assert meta.indexer_metadata is md
                cells = meta.core_metadata.c4_sparse_page_indices[0].long()
                assert (cells[: min(32, n)] >= 0).all() and (cells[min(32, n) :] == -1).all(), (step, l)
                cells = cells[: min(32, n)]
                if l == 0:  # same bits as `got` (same scorer, ix[0], the same block metadata): picks compare exactly
                    assert torch.equal(
                        cells.sort().values, torch.sort(blocks.page_table[0, col // 64].long() * 64 + col % 64).values
                    )
                kv_got = lay.kv.read_chunks(
                    pool.get_extra_key_buffer(ids[l]).view(torch.uint8), cells // 64, cells % 64
                )
                assert torch.equal(kv_got, torch.stack([truth_kv[int(x)][l] for x in locs_of(eng, cells)]))
            checked += 1
        eng.settle()
        eng.level1({})
    assert checked >= 15 and eng.stats()["level1_cycles"] > 0
    locs = torch.tensor(sorted(truth_kv))
    assert torch.equal(
        lay.index.read_chunks(eng.engine.mirror.index[0], locs // 64, locs % 64),
        lay.index.read_chunks(truth_ix0, locs // 64, locs % 64),
    )  # settle moved every Path-I entry
    assert check_invariants(eng.engine) == []
    eng.close()


def locs_of(eng, cells):
    """Pool locs whose published reserve cell is `cells` (shrink mode: mirror chunk == pool loc)."""
    table = eng.engine.lut.table[:-1].long()
    return torch.tensor([int((table == c).nonzero()[0]) for c in cells.tolist()]) if cells.numel() else cells


def _forbid(*a, **k):
    raise AssertionError("host sync inside a CUDA-graph region")


def test_in_graph_paths_have_no_host_sync(sa, monkeypatch):
    """What runs inside the captured decode graph in shrink mode: the c4 KV store swap, the indexer-store swap,
    the reserve-block table and the sink drop. Host syncs there would break capture."""
    pool = make_pool(sa, monkeypatch, shrink=True)
    e = env(score_resident=True)
    eng = build(pool, e, sa.args, shrink=True)
    monkeypatch.setattr(RUNTIME, "engine", eng)
    monkeypatch.setattr(RUNTIME, "pool", pool)
    monkeypatch.setattr(RUNTIME, "env", e)
    pages = [4, 9]
    s = torch.tensor([64 * 4 + 8])
    table = torch.tensor([pages])
    eng.begin_step(["a"], table, s)  # eager: admission, cells assigned
    out_loc = torch.tensor([pages[1] * 64 + 1, 0, 7])
    ids = c4_layer_ids(pool)
    backend = types.SimpleNamespace(
        token_to_kv_pool=pool,
        forward_metadata=types.SimpleNamespace(core_metadata=types.SimpleNamespace(c4_out_loc=out_loc)),
    )
    fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    seen = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, _forbid)
        core = []
        shrink_hooks.around_compress(
            lambda self, *a: core.append(self.forward_metadata.core_metadata.c4_out_loc),
            backend,
            None,
            fb,
            ids[0],
            types.SimpleNamespace(is_in_indexer=False, ratio=4),
        )
        cells = core[0]
        shrink_hooks.around_compress(
            lambda self, *a: seen.append(self.forward_metadata.core_metadata.c4_out_loc),
            backend,
            None,
            fb,
            ids[0],
            types.SimpleNamespace(is_in_indexer=True, ratio=4),
        )
        blocks = eng.block_table(table.to(torch.int32))
        dropped = eng.drop_sink(torch.tensor([[eng.engine.reserve.sink_cell + 3, 5, -1]]))
    sink = eng.engine.reserve.sink_cell
    assert cells[1] == sink and cells[2] == sink and cells[0] != sink and torch.equal(seen[0], cells)
    assert dropped.tolist() == [[-1, 5, -1]] and (blocks >= 0).all()
