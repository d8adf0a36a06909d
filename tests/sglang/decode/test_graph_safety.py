"""What the live server needs of the hooks that the adapter tests do not cover: the reserve is swapped in only
inside attention (the CUDA compressor stores through get_extra_key_buffer too), this step's new c4 entries reach
their reserve cells with a graph-safe copy, and the score-resident view is rebuilt once per forward."""

import dataclasses
import types

import pytest
import torch

from flashmemory.sglang.decode import hooks
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.context import ForwardContext
from flashmemory.sglang.decode.geometry import c4_counts, read_chunk_rows
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.decode.tables import c4_page_table
from tests.sglang.decode.test_copy_adapter import N_C4, PAGE, env, fake_pool, write_chunk

pytestmark = pytest.mark.sglang


def _decode_step(eng, pool):
    """One decode step of request "a" that closes a c4 chunk; returns the chunk's pool loc (already mapped)."""
    pages = [5, 2, 9, 7]
    r2t = torch.full((2, 4 * PAGE), -1, dtype=torch.int64)
    r2t[1] = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
    s = torch.tensor([2 * PAGE + 4])  # token 2*PAGE+3 closes chunk (2*PAGE)//4
    before, after = c4_counts(s)
    assert int(after) == int(before) + 1
    eng.begin_step(["a"], c4_page_table(r2t, torch.tensor([1]), s, PAGE), s)
    return pages[int(before) // 64] * 64 + int(before) % 64


def test_refresh_from_pool_copies_the_new_entry_into_its_cell():
    pool = fake_pool(3)
    eng = build(pool, env(""))
    loc = _decode_step(eng, pool)
    write_chunk(pool, loc, seed=11)  # the compressor stores during the forward
    lay, cell = eng.layout, eng.cells_of(torch.tensor([[loc]])).long().reshape(1)
    assert int(cell) >= 0
    want = read_chunk_rows(lay.kv, pool.c4_kv_pool.kv_buffer, torch.tensor([loc]))
    assert not torch.equal(lay.kv.read_chunks(eng.engine.reserve.kv, cell // 64, cell % 64), want)
    before = eng.engine.reserve.kv.clone()
    sink = eng.engine.reserve.sink_block
    for l in range(N_C4):  # padding / unmapped / out-of-range locs go to the sink
        eng.refresh_from_pool(l, torch.tensor([loc, -1, 3, 10**9]))
    assert torch.equal(lay.kv.read_chunks(eng.engine.reserve.kv, cell // 64, cell % 64), want)
    changed = (eng.engine.reserve.kv != before).any(dim=2)  # [layers, blocks]
    assert set(changed.nonzero()[:, 1].tolist()) <= {int(cell) // 64, sink}
    eng.close()


@pytest.fixture
def live(monkeypatch):
    pool = fake_pool(4)
    eng = build(pool, env(""))
    for name, val in (
        ("engine", eng),
        ("pool", pool),
        ("fwd", ForwardContext()),
        ("env", eng.env),
        ("bufs", None),
        ("counters", {}),
    ):
        monkeypatch.setattr(RUNTIME, name, val)
    yield pool, eng
    eng.close()


def test_reserve_is_read_only_inside_attention(live):
    pool, eng = live
    loc = _decode_step(eng, pool)
    write_chunk(pool, loc, seed=5)
    stock = lambda self, layer_id: self.c4_kv_pool.kv_buffer[self.layer_mapping[layer_id][1]]
    # outside attention (the compressor's store path) the pool is returned
    assert hooks.around_get_extra_key_buffer(stock, pool, 2) is pool.c4_kv_pool.kv_buffer[1]
    core = types.SimpleNamespace(c4_out_loc=torch.tensor([loc]))
    backend = types.SimpleNamespace(token_to_kv_pool=pool, forward_metadata=types.SimpleNamespace(core_metadata=core))
    fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: True))

    def attention(self, q, k, v, layer, forward_batch):
        return {l: hooks.around_get_extra_key_buffer(stock, self.token_to_kv_pool, l) for l in (0, 1, 2)}

    got = hooks.around_attention(attention, backend, None, None, None, types.SimpleNamespace(layer_id=2), fb)
    assert got[2].data_ptr() == eng.reserve_kv(1).data_ptr()  # model layer 2 = c4 layer 1: the reserve
    assert got[1] is pool.c4_kv_pool.kv_buffer[0]  # another layer's buffer is untouched
    assert RUNTIME.fwd.attn_layer is None and RUNTIME.counters["reserve_reads_eager"] == 1
    cell = eng.cells_of(torch.tensor([[loc]])).long().reshape(1)
    assert torch.equal(
        eng.layout.kv.read_chunks(eng.engine.reserve.kv[1:2], cell // 64, cell % 64),
        read_chunk_rows(eng.layout.kv, pool.c4_kv_pool.kv_buffer, torch.tensor([loc]), [1]),
    )


@dataclasses.dataclass
class _Meta:
    page_table: torch.Tensor
    compressed_seq_lens: torch.Tensor
    builds: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.builds.append(1)


def test_resident_view_is_rebuilt_once_per_forward(live):
    md = _Meta(torch.tensor([[3, 4, 8]], dtype=torch.int32), torch.tensor([150], dtype=torch.int32))
    v0 = hooks._resident_metadata(md, 0)
    assert hooks._resident_metadata(md, 1) is v0 and hooks._resident_metadata(md, 2) is v0
    assert RUNTIME.bufs.sel_pages.shape[0] >= RUNTIME.env.decode_max_conc
    v1 = hooks._resident_metadata(md, 0)  # the same metadata object, a new forward (graph capture)
    assert v1 is not v0
    md2 = _Meta(md.page_table.clone(), md.compressed_seq_lens.clone())
    assert hooks._resident_metadata(md2, 1) is not v1  # another forward's metadata


def test_gpu_check_verdicts():
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        "gpu_check_cases", os.path.join(os.path.dirname(__file__), "../../../scripts/gpu_check_cases.py")
    )
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    ref = [[1, 2], [3, 4]]
    good = {"indexer_calls_captured": 8, "reserve_reads_captured": 8, "decode_forwards": 10}
    assert gc.check_case("full", {"tokens": ref, "deterministic": True, "diag": good}, ref) == []
    assert "differ" in gc.check_case("full", {"tokens": [[1]], "deterministic": True, "diag": good}, ref)[0]
    assert "did not run" in gc.check_case("r10", {"tokens": [[1]]}, ref)[0]  # r10 tokens are not compared
    assert "CUDA-graph" in gc.check_case("r10", {"tokens": ref, "diag": {**good, "indexer_calls_captured": 0}}, ref)[0]
    assert "did not load" in gc.check_case("off", {"tokens": ref, "plugin_state": None}, ref)[0]
    assert "stale" in gc.check_case("r10", {"tokens": ref, "diag": {**good, "sideband_stale": 2}}, ref)[0]
    assert gc.tiny_config()["index_topk"] in (512, 1024) and gc.tiny_config()["head_dim"] == 512
    shrunk = {**good, "mode": "shrink", "device_bytes_saved": 5 * 2**20}
    assert gc.check_case("dshrink", {"tokens": ref, "deterministic": True, "diag": shrunk}, ref) == []
    assert "shrink mode" in gc.check_case("dshrink", {"tokens": ref, "diag": {**shrunk, "mode": "copy"}}, ref)[0]
    assert "dstock" in gc.check_case("dshrink", {"tokens": [[9]], "deterministic": True, "diag": shrunk}, ref)[0]
