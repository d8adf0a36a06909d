"""The Level-1 side band under CUDA-graph replay: the indexer hook copies the target layers' inputs in place into
static buffers (recorded into the graph, so replay repeats it), with no host sync or allocation, and Level 1 reads
those buffers after the forward, for the real rows only."""

import dataclasses
import types

import pytest
import torch

from flashmemory.sglang.decode import hooks
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.context import ForwardContext
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.decode.sideband import SidebandBuffers, SidebandError
from tests.sglang.decode.test_copy_adapter import PAGE, env, fake_pool

pytestmark = pytest.mark.sglang
HIDDEN = 16
TARGET_MODEL_LAYER = 2  # fake_pool: model layer 2 = c4 layer 1 = the target layer of env()


def test_write_is_in_place_and_leaves_rows_beyond_the_batch():
    sb = SidebandBuffers.allocate((1, 3), capacity=4, hidden=HIDDEN, dtype=torch.bfloat16, device="cpu")
    ptrs = [sb.hidden[1].data_ptr(), sb.hidden[3].data_ptr(), sb.positions.data_ptr(), sb.written.data_ptr()]
    sb.hidden[1].fill_(7.0)
    sb.positions.fill_(-5)
    x = torch.randn(2, HIDDEN, dtype=torch.bfloat16)
    sb.write(1, x, torch.tensor([100, 200], dtype=torch.int32))
    assert [sb.hidden[1].data_ptr(), sb.hidden[3].data_ptr(), sb.positions.data_ptr(), sb.written.data_ptr()] == ptrs
    assert torch.equal(sb.hidden[1][:2], x) and (sb.hidden[1][2:] == 7.0).all()  # B=2 < capacity=4
    assert sb.positions.tolist() == [100, 200, -5, -5] and sb.written.tolist() == [2, 0]
    assert sb.stale_layers(2) == [3]
    sb.write(3, torch.randn(6, HIDDEN, dtype=torch.bfloat16), torch.arange(6))  # padded beyond capacity
    assert sb.written.tolist() == [2, 4] and sb.stale_layers(2) == [] and sb.stale_layers(4) == [1]
    view = sb.read(2)
    assert view["hidden_1"].data_ptr() == ptrs[0] and view["positions"].shape == (2,)
    sb.begin_forward()
    assert sb.written.tolist() == [0, 0] and sb.written.data_ptr() == ptrs[3]


def _forward(pool, rids, seq, x, positions):
    """Fake decode objects: forward batch, the backend with indexer/core metadata, and the target c4 indexer."""
    mode = types.SimpleNamespace(is_idle=lambda: False, is_decode=lambda: True)
    fb = types.SimpleNamespace(forward_mode=mode, rids=rids, seq_lens=seq, req_pool_indices=torch.tensor([1]))
    core = types.SimpleNamespace(positions=positions, c4_sparse_page_indices=torch.full((x.shape[0], 4), -1))
    md = types.SimpleNamespace(
        page_table=torch.zeros(x.shape[0], 4, dtype=torch.int32),
        compressed_seq_lens=torch.zeros(x.shape[0], dtype=torch.int32),
    )
    backend = types.SimpleNamespace(
        token_to_kv_pool=pool, forward_metadata=types.SimpleNamespace(indexer_metadata=md, core_metadata=core)
    )
    return fb, backend, types.SimpleNamespace(layer_id=TARGET_MODEL_LAYER)


@pytest.fixture
def live(monkeypatch):
    pool = fake_pool(6)
    eng = build(pool, env(""))
    for name, val in (
        ("engine", eng),
        ("pool", pool),
        ("env", eng.env),
        ("features", ("level2", "path_p", "level1")),
        ("bufs", None),
        ("dump", None),
        ("metrics", None),
        ("diag_path", ""),
        ("counters", {}),
        ("sideband", None),
        ("sideband_rows_hint", 4),
        ("_sideband_frozen", False),
        ("_sideband_checked", set()),
        ("_sideband_pending", []),
        ("_sideband_stale", set()),
        ("fwd", ForwardContext()),
    ):
        monkeypatch.setattr(RUNTIME, name, val)
    pages = [5, 2, 9, 7]
    r2t = torch.full((2, 4 * PAGE), -1, dtype=torch.int64)
    r2t[1] = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
    seen = []

    def scorer(row, n_hist, hidden, position):
        seen.append((row, {l: h.clone() for l, h in hidden.items()}, position.clone()))
        return torch.ones(n_hist)

    eng.l1.scorer = scorer
    yield pool, eng, r2t, seen
    eng.close()


def test_level1_reads_the_copied_rows_not_the_forward_tensor(live):
    pool, eng, r2t, seen = live
    s = torch.tensor([2 * PAGE + 4])
    x = torch.randn(2, HIDDEN)  # graph-padded batch of 2, one real request
    want = x[0].clone()
    fb, backend, idx = _forward(pool, ["a"], s, x, torch.tensor([2 * PAGE + 3, 0], dtype=torch.int32))
    RUNTIME.before_forward(fb, r2t)
    out = hooks.around_forward_c4_indexer(lambda *a, **k: "ran", backend, x, None, idx, fb)
    assert out == "ran" and RUNTIME.sideband.capacity == 4
    ptr = RUNTIME.sideband.hidden[1].data_ptr()
    x.fill_(float("nan"))  # the forward's memory is reused (graph pool)
    RUNTIME.after_decode_forward(fb)
    assert len(seen) == 1
    row, hidden, position = seen[0]
    assert row == 0 and torch.equal(hidden[1], want) and int(position) == 2 * PAGE + 3
    # next forward, same buffers (no reallocation); Level 1's job kept its own copy
    x2 = torch.randn(2, HIDDEN)
    fb2, backend2, _ = _forward(pool, ["a"], s + 1, x2, torch.tensor([2 * PAGE + 4, 0]))
    RUNTIME.before_forward(fb2, r2t)
    hooks.around_forward_c4_indexer(lambda *a, **k: None, backend2, x2, None, idx, fb2)
    assert RUNTIME.sideband.hidden[1].data_ptr() == ptr and torch.equal(RUNTIME.sideband.hidden[1][0], x2[0])
    assert torch.equal(hidden[1], want)


def test_stale_side_band_skips_level1(live):
    pool, eng, r2t, seen = live
    s = torch.tensor([2 * PAGE + 4])
    x = torch.randn(1, HIDDEN)
    fb, backend, idx = _forward(pool, ["a"], s, x, torch.tensor([2 * PAGE + 3]))
    RUNTIME.before_forward(fb, r2t)
    hooks.around_forward_c4_indexer(lambda *a, **k: None, backend, x, None, idx, fb)  # allocates the side band
    RUNTIME.before_forward(fb, r2t)  # a forward whose graph lacks the copy
    RUNTIME._sideband_checked.clear()
    RUNTIME.after_decode_forward(fb)
    assert seen == [] and RUNTIME.counters.get("sideband_stale") == 1


def _forbid(*_a, **_k):
    raise AssertionError("host sync / allocation inside the captured hook")


def _fresh_guard(monkeypatch) -> list[str]:
    """A fresh hook guard whose server stop is recorded, not sent (the real one SIGQUITs the parent process)."""
    from flashmemory.sglang.decode import guard as guard_mod

    stops: list[str] = []
    g = guard_mod.Guard(stop=stops.append, configured=True)
    monkeypatch.setattr(RUNTIME, "guard", g)
    return stops


def test_hook_under_capture_has_no_host_sync_or_allocation(live, monkeypatch):
    pool, eng, r2t, seen = live
    eng.size_batch(3)  # the per-batch-row loc map holds the 3 rows, as Runtime.level2_buffers sizes it pre-capture
    s = torch.tensor([2 * PAGE + 4])
    x = torch.randn(3, HIDDEN)
    fb, backend, idx = _forward(pool, ["a"], s, x, torch.tensor([9, 8, 7]))
    monkeypatch.setattr(hooks, "_capturing", lambda: True)
    stops = _fresh_guard(monkeypatch)
    with pytest.raises(SystemExit, match="SidebandError"):  # no buffer yet: refuse to allocate under capture,
        hooks.around_forward_c4_indexer(lambda *a, **k: None, backend, x, None, idx, fb)  # and the guard stops
    assert len(stops) == 1 and "SidebandError" in stops[0]
    _fresh_guard(monkeypatch)
    monkeypatch.setattr(hooks, "_capturing", lambda: False)
    hooks.around_forward_c4_indexer(lambda *a, **k: None, backend, x, None, idx, fb)  # eager warmup allocates
    sb = RUNTIME.sideband
    ptrs = (sb.hidden[1].data_ptr(), sb.positions.data_ptr(), sb.written.data_ptr())
    x2 = torch.randn(3, HIDDEN)
    fb2, backend2, _ = _forward(pool, ["a"], s, x2, torch.tensor([4, 5, 6]))
    monkeypatch.setattr(hooks, "_capturing", lambda: True)
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, _forbid)
        for name in ("empty", "zeros", "ones", "full", "tensor", "empty_like", "zeros_like", "full_like"):
            m.setattr(torch, name, _forbid)
        m.setattr(type(eng), "cells_of", lambda self, locs: locs)  # Level 2 is not under test
        hooks.around_forward_c4_indexer(lambda *a, **k: None, backend2, x2, None, idx, fb2)
    assert (sb.hidden[1].data_ptr(), sb.positions.data_ptr(), sb.written.data_ptr()) == ptrs and RUNTIME.sideband is sb
    assert torch.equal(sb.hidden[1][:3], x2) and sb.positions[:3].tolist() == [4, 5, 6] and RUNTIME._sideband_frozen
    with pytest.raises(SidebandError):  # after capture a misfit never reallocates
        RUNTIME.capture_sideband_input(1, torch.randn(2, HIDDEN + 1), torch.arange(2), capturing=False)


@dataclasses.dataclass
class _IndexerMetadata:  # the two fields the score-resident view replaces (sglang's is a dataclass too)
    page_table: torch.Tensor
    compressed_seq_lens: torch.Tensor


def test_the_first_decode_step_scores_what_is_resident(live):
    """A fresh server's first decode forward: before_forward allocates the Level-2 buffers and publishes the
    admitted row's resident pages before the indexer hook reads them (lazily allocated by the hook instead,
    they were empty on that step and the row scored its newest page alone)."""
    pool, eng, r2t, _ = live
    s = torch.tensor([2 * PAGE + 4])  # 129 c4 chunks: pages 0, 1, 2
    fb, backend, idx = _forward(pool, ["a"], s, torch.randn(1, HIDDEN), torch.tensor([2 * PAGE + 3]))
    assert RUNTIME.bufs is None
    RUNTIME.before_forward(fb, r2t)
    resident = [p for p in eng.resident_pages(eng.step_rows)[0].tolist() if p >= 0]
    assert len(resident) > 1 and resident[-1] == 2  # the warm start's pages and the newest one
    assert [p for p in RUNTIME.bufs.sel_pages[0].tolist() if p >= 0] == resident
    md = _IndexerMetadata(torch.tensor([[0, 1, 2, -1]], dtype=torch.int32), torch.tensor([129], dtype=torch.int32))
    view = hooks._resident_metadata(md, 0)
    assert view.compressed_seq_lens.tolist()[0] == sum(min(64, 129 - 64 * p) for p in resident)


def test_freshness_is_checked_without_a_host_wait(monkeypatch):
    """On a stream device the forward's `written` counts reach the host through pinned memory and an event, read
    once the event says the copy is complete: no blocking operation on the decode thread. A stale batch size
    skips Level 1 until a fresh verdict; while a verdict is still on its way, the step goes to Level 1."""
    from tests.support.cuda_standin import count_blocking, on_device, on_thread, reset

    count_blocking(monkeypatch)
    sb = SidebandBuffers.allocate((1, 3), 4, HIDDEN, torch.float32, torch.device("cpu"))
    for name, val in (("sideband", sb), ("diag_path", "on"), ("counters", {}), ("_sideband_checked", set()),
                      ("_sideband_pending", []), ("_sideband_stale", set())):  # fmt: skip
        monkeypatch.setattr(RUNTIME, name, val)
    x, pos = on_device(torch.randn(2, HIDDEN)), on_device(torch.tensor([5, 6]))  # the forward's tensors
    reset()
    sb.begin_forward()
    sb.write(1, x, pos)  # layer 3's hook did not run: stale (the stand-in's copy is complete at once)
    assert RUNTIME.sideband_snapshot(2) is None and RUNTIME.counters.get("sideband_stale") == 1
    event = type(RUNTIME._sideband_pending[0][3]) if RUNTIME._sideband_pending else None
    sb.begin_forward()
    sb.write(1, x, pos)
    sb.write(3, x, pos)
    assert RUNTIME.sideband_snapshot(2) is not None  # fresh again
    assert not on_thread(), [b.where for b in on_thread()]
    monkeypatch.setattr(torch.cuda.Event, "query", lambda self: False)  # a copy still in flight
    sb.begin_forward()
    sb.write(1, x, pos)
    assert RUNTIME.sideband_snapshot(2) is not None and len(RUNTIME._sideband_pending) == 1
    assert not on_thread() and event is None
