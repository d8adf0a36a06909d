"""Level 1 as the HiSparse prefetch hint source: the mode's hooks driven with stand-ins for sglang's model runner,
DSv4 pool (c4 index-K pages), indexer backend and HiSparse coordinator; Level 1 runs synchronously."""

from __future__ import annotations

import types

import pytest
import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.retriever.fp8 import dequantize_chunks, pages_to_chunks
from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.sglang.decode.context import HiSparseState
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.hisparse import prefetch as hp
from flashmemory.sglang.hisparse.state import PrefetchState
from tests.sglang.hisparse.test_prefetch import K, _coordinator

pytestmark = pytest.mark.sglang
PAGE, N_PAGES, N_C4, HIDDEN = 256, 16, 2, 16  # full-KV page (64 c4 entries), c4 pool pages, c4 layers
LENS = (4 * 390, 4 * 300)  # tokens of the two requests: 390 and 300 c4 entries
HOT = 256  # hot-buffer slots: room for 240 hinted positions


def _pool(seed: int = 0) -> types.SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    kv = [torch.zeros(N_PAGES, 37440, dtype=torch.uint8) for _ in range(N_C4)]
    ix = [torch.randint(0, 256, (N_PAGES, 64 * 132), dtype=torch.uint8, generator=g) for _ in range(N_C4)]
    for t in ix:  # finite scales and no NaN fp8 patterns, so the keys are usable
        t[:, 64 * 128 :] = torch.full((N_PAGES, 64), 0.01).view(torch.uint8).reshape(N_PAGES, 256)
        t[:, : 64 * 128] &= 0x77
    c4 = types.SimpleNamespace(kv_buffer=kv, page_size=PAGE // 4)
    ixp = types.SimpleNamespace(index_k_with_scale_buffer=ix, page_size=PAGE // 4, index_head_dim=128)
    mapping = [(0, 0, None)] + [(4, i, c4) for i in range(N_C4)]
    return types.SimpleNamespace(c4_kv_pool=c4, c4_indexer_kv_pool=ixp, page_size=PAGE, layer_mapping=mapping)


def _req_to_token() -> torch.Tensor:
    """Rows 0 and 2 of the coordinator's request slots; their logical pages sit at pool pages 9.. and 1.. (reversed
    order for row 0, so a page table read wrongly would read other pages)."""
    r2t = torch.zeros(3, 8 * PAGE, dtype=torch.int64)
    for row, pages in ((0, [15, 14, 13, 12, 11, 10, 9]), (2, [1, 2, 3, 4, 5])):
        for p, page in enumerate(pages):
            r2t[row, p * PAGE : (p + 1) * PAGE] = page * PAGE + torch.arange(PAGE)
    return r2t


@pytest.fixture
def hint_mode(monkeypatch):
    state = PrefetchState()
    monkeypatch.setattr(RUNTIME, "hisparse", HiSparseState(prefetch=state))
    env = FlashMemoryEnv(
        hisparse_prefetch=True,
        hisparse_prefetch_width=16,
        retriever_ckpt="in-memory",
        retriever_layers=(1,),
        interval=2,
        page_kmax=5,
        last_keep=64,
        async_recall=False,
        decode_max_conc=2,
    )
    for k, v in (
        ("env", env),
        ("sideband", None),
        ("sideband_rows_hint", 0),
        ("_sideband_frozen", False),
        ("_sideband_checked", set()),
        ("diag_path", ""),
    ):
        monkeypatch.setattr(RUNTIME, k, v)
    torch.manual_seed(0)
    monkeypatch.setattr(
        RUNTIME,
        "retriever",
        JointRetriever((1,), RetrieverDims(hidden=HIDDEN, rank=8, n_heads=2, head_dim=128, rope_dim=64)),
    )
    pool = _pool()
    runner = types.SimpleNamespace(
        hisparse_coordinator=_coordinator(hot=HOT),
        token_to_kv_pool=pool,
        max_running_requests=2,
        req_to_token_pool=types.SimpleNamespace(req_to_token=_req_to_token()),
    )
    yield state, runner
    if hp.hint() is not None:
        hp.hint().close()


def _batch(step: int) -> types.SimpleNamespace:
    mode = types.SimpleNamespace(is_decode=lambda: True, is_idle=lambda: False)
    return types.SimpleNamespace(
        forward_mode=mode,
        rids=["a", "b"],
        req_pool_indices=torch.tensor([0, 2]),
        seq_lens_cpu=torch.tensor(LENS) + step,
    )


def _step(runner, step: int, indexer: bool = True) -> None:
    """One decode forward as the mode's hooks see it: publish, the c4 layers' indexers, then Level 1."""
    fb = _batch(step)
    hp.before_forward(runner, fb)
    backend = types.SimpleNamespace(
        token_to_kv_pool=runner.token_to_kv_pool,
        forward_metadata=types.SimpleNamespace(core_metadata=types.SimpleNamespace(positions=fb.seq_lens_cpu - 1)),
    )
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(step))
    for layer_id in (1, 2) if indexer else ():
        hp.around_indexer(lambda *a, **k: "picks", backend, x, None, types.SimpleNamespace(layer_id=layer_id), fb)
    hp.after_forward(None, runner, fb)


def test_level1_publishes_hints_after_its_cycle_and_none_before(hint_mode):
    state, runner = hint_mode
    hp.after_init_hisparse(None, runner)
    src = hp.hint()
    assert src is not None and not state.pending
    _step(runner, 0, indexer=False)  # the side band was not written: no cycle, no hint
    assert not state.pending and src.snapshot()["cycles"] == 0
    _step(runner, 1)  # a new row's first step is due
    assert set(state.pending) == {"a", "b"} and src.snapshot()["cycles"] == 2
    for rid, tokens in zip("ab", LENS):
        n = (tokens + 1) // 4  # c4 entries after step 1
        p = state.pending[rid]
        assert 0 < p.numel() <= HOT - K and p.unique().numel() == p.numel()
        assert int(p.max()) < n - K  # never the newest K entries (nor L-1)
    _step(runner, 2)  # tau = 2: not due
    assert src.snapshot()["cycles"] == 2
    _step(runner, 3)
    assert src.snapshot()["cycles"] == 4


def test_hint_pages_follow_the_retriever_scores_over_sglangs_index_k(hint_mode):
    state, runner = hint_mode
    hp.after_init_hisparse(None, runner)
    src = hp.hint()
    _step(runner, 1)
    row = src.by_rid["a"]
    keys = src.target_keys(row, 1)
    pool_pages = torch.tensor([15, 14, 13, 12, 11, 10, 9])
    want = dequantize_chunks(
        pages_to_chunks(runner.token_to_kv_pool.c4_indexer_kv_pool.index_k_with_scale_buffer[1][pool_pages], 390, 128)
    )
    assert torch.equal(keys, want)  # the row's logical pages, read through sglang's page table
    hidden = RUNTIME.sideband.read(2)["hidden_1"][0]
    with torch.no_grad():
        scores = RUNTIME.retriever.layer(1)(hidden.reshape(1, -1), torch.tensor([4 * 390]), keys)[0]
    pages = state.pending["a"].div(64, rounding_mode="floor").unique_consecutive()
    best = [float(scores[int(p) * 64 : (int(p) + 1) * 64].max()) for p in pages]
    tail_page = (390 - 64) // 64  # last_keep = 64 entries
    scored = [b for p, b in zip(pages.tolist(), best) if p < tail_page]
    assert scored and scored == sorted(scored, reverse=True)  # scored pages first, best chunk score first


def test_without_a_retriever_checkpoint_nothing_of_level1_runs(hint_mode, monkeypatch):
    state, runner = hint_mode
    monkeypatch.setattr(RUNTIME, "env", FlashMemoryEnv(hisparse_prefetch=True, hisparse_prefetch_width=16))
    hp.after_init_hisparse(None, runner)
    assert hp.hint() is None
    _step(runner, 1)
    assert RUNTIME.sideband is None and not state.pending


def test_a_finished_request_leaves_level1(hint_mode):
    state, runner = hint_mode
    hp.after_init_hisparse(None, runner)
    _step(runner, 1)
    hp.after_request_finished(
        None, runner.hisparse_coordinator, types.SimpleNamespace(rid="a", kv=types.SimpleNamespace(req_pool_idx=0))
    )
    assert "a" not in state.pending and "a" not in hp.hint().by_rid and "b" in hp.hint().by_rid
    with pytest.raises(KeyError):
        hp.hint().gen(0)
