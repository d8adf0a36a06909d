"""The HiSparse prefetch mode's gate, hooks and stream order: the hooks driven with a stand-in for sglang's
HiSparseCoordinator (its state tensors, the torch swap-in op as its kernel), on CPU and with the recording
stand-in for torch.cuda (tests/support/cuda_standin.py) for the GPU path's fork and join."""

from __future__ import annotations

import types

import pytest
import torch

from flashmemory.env import EnvError, FlashMemoryEnv
from flashmemory.sglang.cpu.ops import hisparse as hs
from flashmemory.sglang.decode.context import HiSparseState
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.hisparse import prefetch as hp
from flashmemory.sglang.hisparse.state import PrefetchState
from flashmemory.sglang.plumbing.patching import StartupError, select
from flashmemory.sglang.plumbing.targets import features_for
from tests.support.cuda_standin import install

pytestmark = pytest.mark.sglang
HOT, K, LAYERS, ROWS, MAXLEN = 64, 16, 2, 3, 400


def _coordinator(hot: int = HOT, seed: int = 0) -> types.SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    width = hot + 64
    dev_pages = -(-ROWS * width // 64)
    host = [
        torch.randint(0, 256, (-(-ROWS * MAXLEN // 64), hs.PAGE_BYTES), dtype=torch.uint8, generator=g)
        for _ in range(LAYERS)
    ]
    return types.SimpleNamespace(
        device_buffer_size=hot,
        top_k=K,
        is_dsv4_hisparse=True,
        enable_prefetch=False,
        item_size_bytes=hs.ITEM_BYTES,
        swap_in_block_size=960,
        num_real_reqs=torch.zeros(1, dtype=torch.int32),
        req_device_buffer_tokens=torch.full((LAYERS, ROWS, width), -1, dtype=torch.int32),
        req_device_buffer_token_locs=torch.arange(LAYERS * ROWS * width, dtype=torch.int32).view(LAYERS, ROWS, width)
        % (ROWS * width),
        lru_slots=torch.arange(hot, dtype=torch.int16).repeat(LAYERS, ROWS, 1),
        req_to_host_pool=torch.arange(ROWS * MAXLEN, dtype=torch.int64).view(ROWS, MAXLEN),
        mem_pool_host=types.SimpleNamespace(kv_buffer=host),
        mem_pool_device=types.SimpleNamespace(
            kv_buffer=[torch.zeros(dev_pages, hs.PAGE_BYTES, dtype=torch.uint8) for _ in range(LAYERS)]
        ),
        top_k_device_locs_buffer=torch.zeros((ROWS, K), dtype=torch.int32),
    )


def swap_in(co, req_pool_indices, lens, picks, layer_id):
    """What `_run_swap_in_kernel` does, with the torch op as the kernel; returns the step's output rows."""
    bs = req_pool_indices.shape[0]
    out = co.top_k_device_locs_buffer[:bs, :K]
    hs.load_cache_to_device_buffer_dsv4(
        picks,
        co.req_device_buffer_tokens[layer_id],
        co.req_to_host_pool,
        co.req_device_buffer_token_locs[layer_id],
        co.mem_pool_host.kv_buffer[layer_id],
        co.mem_pool_device.kv_buffer[layer_id],
        out,
        req_pool_indices,
        lens,
        co.lru_slots[layer_id],
        K,
        co.device_buffer_size,
        co.num_real_reqs,
    )
    return out


def _batch(rids, decode=True):
    mode = types.SimpleNamespace(is_decode=lambda: decode, is_idle=lambda: False)
    return types.SimpleNamespace(forward_mode=mode, rids=list(rids))


@pytest.fixture
def mode(monkeypatch):
    state = PrefetchState()
    monkeypatch.setattr(RUNTIME, "hisparse", HiSparseState(prefetch=state))
    monkeypatch.setattr(RUNTIME, "env", FlashMemoryEnv(hisparse_prefetch=True, hisparse_prefetch_width=16))
    return state


def test_gate_env_refusal_features_and_rows():
    env = FlashMemoryEnv.from_environ(
        {"SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "1", "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH": "32"}
    )
    assert env.hisparse_prefetch and env.hisparse_prefetch_width == 32 and env.hisparse_prefetch_budget == 0
    assert features_for(env) == ("hisparse_prefetch", "hisparse_prefetch_sync")
    assert select(["hisparse_prefetch_sync"])[0].impl.endswith(":before_destroy")
    assert features_for(FlashMemoryEnv.from_environ({})) == ()
    with pytest.raises(EnvError, match="SGLANG_DECODE_SWAP_P"):
        FlashMemoryEnv.from_environ({"SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "1", "SGLANG_DECODE_SWAP_P": "1"})
    rows = select(["hisparse_prefetch"])
    assert {p.impl.rsplit(":", 1)[1] for p in rows} == {
        "after_init_hisparse",
        "before_forward",
        "around_swap_in",
        "around_model_forward",
        "after_request_finished",
        "after_forward",
        "around_indexer",
    }
    assert not select(features_for(FlashMemoryEnv())) or all(
        p.feature != "hisparse_prefetch" for p in select(features_for(FlashMemoryEnv()))
    )


def test_no_target_is_hooked_by_both_the_cpu_layer_and_the_mode():
    """sglang's HookRegistry applies each target once: a hook the CPU layer (applied first) already holds would
    not apply for the mode, and the server would refuse to start."""
    from flashmemory.sglang.plumbing.patching import CPU_FEATURES, HOOK_KINDS

    env = FlashMemoryEnv.from_environ(
        {
            "SGLANG_FLASHMEMORY_CPU": "1",
            "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "1",
            "SGLANG_RETRIEVER_INLINE_CKPT": "/x.pt",
        }
    )
    cpu = {p.target for p in select(CPU_FEATURES) if p.kind in HOOK_KINDS}
    mode_rows = {p.target for p in select(features_for(env)) if p.kind in HOOK_KINDS}
    assert mode_rows and not cpu & mode_rows, cpu & mode_rows


def test_refused_without_dsv4_hisparse_with_sglang_prefetch_or_without_room(mode):
    for co, what in (
        (None, "needs sglang's HiSparse"),
        (types.SimpleNamespace(is_dsv4_hisparse=False), "needs"),
        (types.SimpleNamespace(is_dsv4_hisparse=True, enable_prefetch=True), "shared-index"),
    ):
        with pytest.raises(StartupError, match=what):
            hp.after_init_hisparse(None, types.SimpleNamespace(hisparse_coordinator=co))
    with pytest.raises(StartupError, match="no room"):
        hp.after_init_hisparse(None, types.SimpleNamespace(hisparse_coordinator=_coordinator(hot=K)))


def test_hint_is_capped_deduplicated_published_once_and_lands(mode):
    co = _coordinator()
    hp.after_init_hisparse(None, types.SimpleNamespace(hisparse_coordinator=co))
    assert (mode.width, mode.budget) == (16, HOT - K)
    assert mode.set_hint("a", torch.arange(300, 300 + HOT)) == HOT - K  # capped at H-K per cycle
    assert mode.set_hint("b", torch.tensor([5, 5, 6, -1])) == 2
    rids, rows, lens = ["a", "b"], torch.tensor([0, 2]), torch.tensor([380, 200])
    picks = torch.stack([torch.arange(100, 100 + K), torch.arange(20, 20 + K)]).to(torch.int32)
    loaded = []
    for _step in range(4):
        hp.before_forward(types.SimpleNamespace(), _batch(rids))
        co.num_real_reqs.fill_(2)
        for layer in range(LAYERS):
            out = hp.around_swap_in(swap_in, co, rows, lens, picks, layer)
            assert out.data_ptr() == co.top_k_device_locs_buffer.data_ptr()  # the step's own output rows
        loaded.append(mode.counts.snapshot()["loaded"])
    # a: 48 positions in slices of 16 over 3 steps, at both layers; b: 2 positions once; then nothing is left
    assert loaded == [2 * (16 + 2), 2 * (32 + 2), 2 * (48 + 2), 2 * (48 + 2)]
    assert mode.active == 0 and not mode.pending
    later = torch.tensor([5, 6] + list(range(20, 20 + K - 2)))
    picks = torch.stack([torch.arange(300, 300 + K), later]).to(torch.int32)
    hp.before_forward(types.SimpleNamespace(), _batch(rids))
    for layer in range(LAYERS):
        hp.around_swap_in(swap_in, co, rows, lens, picks, layer)
    c = mode.counts.snapshot()
    assert c["used"] == 2 * (K + 2) and c["calls"] == 3 * LAYERS
    hp.after_request_finished(None, co, types.SimpleNamespace(rid="a", kv=types.SimpleNamespace(req_pool_idx=0)))
    assert mode.counts.snapshot()["wasted"] == 2 * (HOT - K - K)  # a's prefetched entries never picked


def test_an_extend_forward_or_a_sglang_prefetch_runs_no_prefetch(mode):
    co = _coordinator()
    hp.after_init_hisparse(None, types.SimpleNamespace(hisparse_coordinator=co))
    mode.set_hint("a", torch.arange(300, 340))
    hp.before_forward(types.SimpleNamespace(), _batch(["a"], decode=False))
    co.num_real_reqs.fill_(1)
    hp.around_swap_in(swap_in, co, torch.tensor([0]), torch.tensor([380]), torch.arange(K, dtype=torch.int32)[None], 0)
    assert mode.counts.snapshot()["loaded"] == 0 and int(mode.pf_active) == 0


def test_gpu_path_forks_after_the_swap_in_and_joins_before_the_next_forward(mode, monkeypatch):
    si = install(monkeypatch)
    co = _coordinator()
    fwd, idx = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(fwd):
        hp.after_init_hisparse(None, types.SimpleNamespace(hisparse_coordinator=co))
    assert mode.stream is not None and mode.provenance is None
    kernel_calls = []

    def kernel(**kw):
        kernel_calls.append(kw)
        si.op("write", ("buffer", kw["lru_slots"].data_ptr()))
        si.op("read", "pf_pos")

    def demand(co_, rows, lens, picks, layer):
        si.op("write", ("buffer", co_.lru_slots[layer].data_ptr()))
        return co_.top_k_device_locs_buffer[: rows.shape[0], :K]

    monkeypatch.setattr(hp, "_gpu_swap_in", kernel)

    def forward(step):
        with torch.cuda.stream(fwd):
            si.op("write", "pf_pos")
            hp.before_forward(types.SimpleNamespace(), _batch(["a"]))

            def model(_self):
                for layer in range(LAYERS):
                    idx.wait_stream(fwd)
                    with torch.cuda.stream(idx):
                        hp.around_swap_in(
                            demand,
                            co,
                            torch.tensor([0]),
                            torch.tensor([380]),
                            torch.zeros((1, K), dtype=torch.int32),
                            layer,
                        )
                    fwd.wait_stream(idx)
                    si.op("read", ("attention", step, layer))

            hp.around_model_forward(model, None)
            si.op("write", ("recycle", step))  # what runs after the forward on its stream

    mode.set_hint("a", torch.arange(300, 340))
    for step in range(2):
        forward(step)
    assert len(kernel_calls) == 2 * LAYERS
    kw = kernel_calls[0]
    assert kw["top_k_device_locs"].data_ptr() == mode.scratch.data_ptr() != co.top_k_device_locs_buffer.data_ptr()
    assert kw["num_real_reqs"] is mode.pf_active and kw["num_top_k"] == mode.width
    assert kw["top_k_tokens"].data_ptr() == mode.pf_clean.data_ptr()
    assert not si.races(lambda r: r in ("pf_pos",) or (isinstance(r, tuple) and r[0] == "buffer")), "unordered"
    log = si.log
    pf = [o for o in log if o.stream == mode.stream.id and o.kind == "write"]
    assert pf and all(o.stream not in (fwd.id, idx.id) for o in pf)
    for o in pf:
        own = [d for d in log if d.resource == o.resource and d.stream == idx.id and d.index < o.index][-1]
        assert o.after(own)  # after the layer's own swap-in
        later = [r for r in log if r.index > o.index and r.resource[0] == "recycle"]
        assert later and later[0].after(o)  # joined before the forward ends
        attention = [r for r in log if r.index > o.index and r.resource[0] == "attention"][0]
        assert not attention.after(o)  # not on this layer's attention path
    hp.before_destroy(co)
    assert ("MainThread", f"stream {mode.stream.name}") in si.host_syncs


def test_prefetch_patch_rows_match_the_installed_sglang():
    pytest.importorskip("sglang")
    from flashmemory.sglang.plumbing.patch_spec import check_signature

    for p in hp.PREFETCH_PATCHES:
        check_signature(p)


def test_through_sglangs_own_swap_in_method(mode, monkeypatch):
    """sglang's `swap_in_selected_pages` and `_run_swap_in_kernel` themselves (bound to the stand-in coordinator,
    the kernel name pointed at the torch op): the step's picks read their host bytes while hints land and hit."""
    pytest.importorskip("sglang")
    from sglang.srt.managers import hisparse_coordinator as hc

    misses = []

    def kernel(*, page_size, block_size, skip_io=False, item_size_bytes, **kw):
        assert page_size == 1 and not skip_io and item_size_bytes == hs.ITEM_BYTES
        misses.append(hs.load_cache_to_device_buffer_dsv4(**kw).misses)

    monkeypatch.setattr(hc, "load_cache_to_device_buffer_dsv4_mla", kernel)
    co = _coordinator(seed=3)
    co.skip_io = False
    co._run_swap_in_kernel = types.MethodType(hc.HiSparseCoordinator._run_swap_in_kernel, co)
    hp.after_init_hisparse(None, types.SimpleNamespace(hisparse_coordinator=co))
    rows, lens = torch.tensor([1]), torch.tensor([390])
    g = torch.Generator().manual_seed(7)
    trace = [torch.randperm(389, generator=g)[:K].to(torch.int32) for _ in range(6)]
    for t, picks in enumerate(trace):
        if t + 1 < len(trace):
            mode.set_hint("r", trace[t + 1])  # an oracle hint: the next step's picks
        hp.before_forward(types.SimpleNamespace(), _batch(["r"]))
        co.num_real_reqs.fill_(1)
        for layer in range(LAYERS):
            out = hp.around_swap_in(hc.HiSparseCoordinator.swap_in_selected_pages, co, rows, lens, picks[None], layer)
            for loc, p in zip(out[0].tolist(), picks.tolist()):
                d = hs.token_byte_offsets(torch.tensor([loc]))
                h = hs.token_byte_offsets(co.req_to_host_pool[1, p : p + 1])
                assert torch.equal(
                    co.mem_pool_device.kv_buffer[layer].view(-1)[d], co.mem_pool_host.kv_buffer[layer].view(-1)[h]
                )
    c = mode.counts.snapshot()
    # after the cold first step no pick misses: each was prefetched (a hit on a prefetched slot) or still resident
    assert misses[:LAYERS] == [K] * LAYERS and not any(misses[LAYERS:]), misses
    assert c["used"] + c["resident"] == (len(trace) - 1) * K * LAYERS and c["used"] == c["loaded"] > 0
