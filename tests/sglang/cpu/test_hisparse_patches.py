"""The HiSparse CPU patches (flashmemory/sglang/cpu/patches_hisparse.py): the gate, stock behaviour with it off
(every hook, the host pool's too), and with it on the backup rule of `_eager_backup_previous_token` on sglang's
real `DeepSeekV4PagedHostPool`, counted swap-ins, the PD admission's newest entry and the table. The host pool's
copies are in test_hisparse_pool.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from flashmemory.sglang.cpu import hisparse_pool as hpool  # noqa: E402
from flashmemory.sglang.cpu import patches_hisparse as hp  # noqa: E402
from flashmemory.sglang.cpu.hisparse_record import SwapInCounter  # noqa: E402
from flashmemory.sglang.cpu.ops import hisparse as hs  # noqa: E402
from flashmemory.sglang.decode.context import HiSparseState  # noqa: E402
from flashmemory.sglang.decode.runtime import RUNTIME  # noqa: E402


@pytest.fixture
def gate(monkeypatch):
    """Turns the CPU+HiSparse gate on for one test."""
    monkeypatch.setattr(hp, "hisparse_on_cpu", lambda: True)


@pytest.fixture(autouse=True)
def _ram_check_off(monkeypatch):
    """The host pool's free-RAM check reads the machine's free memory, which other jobs on a shared box can push
    below zero; these pools are a few hundred KB."""
    import sglang.srt.mem_cache.memory_pool_host as mph

    monkeypatch.setattr(mph, "host_memory_budget_bytes", lambda: 1 << 40)


def _pool(layers: int = 2, dev_pages: int = 3, host_pages: int = 4, seed: int = 0):
    """sglang's own host pool (unpinned), small, filled with random bytes on both sides."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    g = torch.Generator().manual_seed(seed)
    dev = [torch.randint(0, 256, (dev_pages, hs.PAGE_BYTES), dtype=torch.uint8, generator=g) for _ in range(layers)]
    pool = DeepSeekV4PagedHostPool("t", dev, hs.PAGE_BYTES, host_pages, hs.C4_PAGE, pin_memory=False)
    for b in pool.kv_buffer:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return pool


def _token(cache: torch.Tensor, loc: int) -> bytes:
    flat = cache.view(-1)
    return bytes(flat[hs.token_byte_offsets(torch.tensor([loc]))[0]].tolist())


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "stock"


@pytest.mark.parametrize(
    "args, on",
    [
        (None, False),  # no server args published (a tool)
        (SimpleNamespace(device="cpu", enable_hisparse=True), True),  # the one case the gate is on
        (SimpleNamespace(device="cuda", enable_hisparse=True), False),  # HiSparse on a GPU: sglang's own kernels
        (SimpleNamespace(device="cpu", enable_hisparse=False), False),  # CPU server without HiSparse
        (SimpleNamespace(device="cpu"), False),  # args without the field
        (SimpleNamespace(enable_hisparse=True), False),  # args without a device
    ],
)
def test_gate_is_off_outside_a_hisparse_cpu_server(monkeypatch, args, on):
    """The gate reads the server args sglang publishes in this process: on only with device cpu AND HiSparse."""
    import sglang.srt.runtime_context as rc

    def published():
        if args is None:
            raise AttributeError("no server args in this process")
        return args

    monkeypatch.setattr(rc, "get_server_args", published)
    assert hp.hisparse_on_cpu() is on
    assert hp.serving_on_cpu() is (args is not None and getattr(args, "device", None) == "cpu")


def test_gate_off_calls_sglang_unchanged():
    pool, orig = _pool(), Recorder()
    h, d = torch.arange(3), torch.arange(3)
    assert hpool.backup_tokens(orig, pool, h, d) == "stock"
    assert hpool.backup_all_layers(orig, pool, None, h, d, "kernel") == "stock"
    assert hpool.load_layer(orig, pool, None, h, d, 1, "kernel", is_draft=True) == "stock"
    assert hpool.alloc_host(orig, (2, 3), torch.uint8, "cpu", True, None) == "stock"
    assert hp.destroy(orig, object()) == "stock"
    assert hp.eager_backup(orig, "co", 1, 2, 3, 4) == "stock"
    assert len(orig.calls) == 6
    assert orig.calls[2] == ((pool, None, h, d, 1, "kernel"), {"is_draft": True})


def test_eager_backup_rule(gate):
    """ratio 4, hot 8: request slot 0 (seq 13: (13-1) % 4 == 0, previous entry at position 2, short: slot 2),
    slot 1 (seq 61: position 14 > hot -> reserved slot 8), slot 2 (seq 14: nothing new) and slot 3 (first
    step after staging: skipped once)."""
    pool = _pool()
    pool.backup_tokens_from_device_all_layer = lambda h, d: hpool.backup_tokens(None, pool, h, d)  # as installed
    hot, width = 8, 8 + hs.C4_PAGE
    req_to_device = torch.arange(4 * width, dtype=torch.int64).view(4, width) % (3 * hs.C4_PAGE)
    co = SimpleNamespace(
        compress_ratio=4,
        device_buffer_size=hot,
        _skip_first_backup=[False, False, False, True],
        req_to_device_buffer=req_to_device,
        mem_pool_host=pool,
        is_dsv4_hisparse=True,
        req_to_host_pool=torch.full((4, 128), -1, dtype=torch.int64),
        req_to_host_pool_allocated_len=torch.tensor([64, 64, 0, 0]),
        waited=[],
        wait_for_pending_backup=lambda: co.waited.append(1),
    )
    co.req_to_host_pool[0, :64] = torch.arange(64, 128)  # first host pages, staged at admission
    co.req_to_host_pool[1, :64] = torch.arange(128, 192)
    seq = torch.tensor([13, 61, 14, 17])
    rids = torch.tensor([0, 1, 2, 3])
    hp.eager_backup(None, co, seq, rids, seq.clone(), rids.clone())
    assert co._skip_first_backup == [False] * 4 and co.waited == [1]
    for rid, pos, slot, host_loc in ((0, 2, 2, 66), (1, 14, hot, 142)):
        assert int(co.req_to_host_pool[rid, pos]) == host_loc
        for layer in range(2):
            assert _token(pool.kv_buffer[layer], host_loc) == _token(
                pool.device_buffers[layer], int(req_to_device[rid, slot])
            )
    assert int(co.req_to_host_pool_allocated_len[2]) == 0 and int(co.req_to_host_pool_allocated_len[3]) == 0


def test_swap_in_is_counted_and_refuses_other_modes(gate, monkeypatch):
    counter = SwapInCounter()
    monkeypatch.setattr(RUNTIME, "hisparse", HiSparseState(swapin=counter))
    hot, k, width = 4, 3, 4 + hs.C4_PAGE
    g = torch.Generator().manual_seed(1)
    host = torch.randint(0, 256, (2, hs.PAGE_BYTES), dtype=torch.uint8, generator=g)
    dev = torch.zeros(2, hs.PAGE_BYTES, dtype=torch.uint8)
    tokens = torch.full((1, width), -1, dtype=torch.int32)
    tokens[0, :hot] = torch.arange(hot, dtype=torch.int32)
    locs = torch.arange(width, dtype=torch.int32).view(1, width)
    host_locs = torch.arange(100, 120, dtype=torch.int64).view(1, 20)
    lru = torch.arange(hot, dtype=torch.int16).view(1, hot)
    out = torch.full((1, k), -1, dtype=torch.int32)
    args = dict(
        top_k_tokens=torch.tensor([[9, 2, 7]], dtype=torch.int32),
        device_buffer_tokens=tokens,
        host_cache_locs=host_locs,
        device_buffer_locs=locs,
        host_cache=host,
        device_buffer=dev,
        top_k_device_locs=out,
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([10]),
        lru_slots=lru,
        item_size_bytes=hs.ITEM_BYTES,
        num_top_k=k,
        hot_buffer_size=hot,
    )
    hp.swap_in_dsv4(None, **args)
    # 9 = newest (reserved slot), 2 hits, 7 misses -> one 584-B token copied host loc 107 -> the oldest slot 0
    assert counter.snapshot() == {"calls": 1, "lookups": 3, "hits": 2, "misses": 1, "bytes_h2d": hs.ITEM_BYTES}
    assert _token(dev, 0) == _token(host, 107)
    with pytest.raises(NotImplementedError, match="plan recording"):
        hp.swap_in_dsv4(None, **args, miss_src=torch.zeros(1, 4, dtype=torch.int64))


def test_table_names_sglang_lines_and_resolves():
    from flashmemory.sglang.plumbing.patching import TABLES, check_all, load_impl

    assert "flashmemory.sglang.cpu.patches_hisparse:HISPARSE_PATCHES" in TABLES
    assert len({p.target for p in hp.HISPARSE_PATCHES}) == len(hp.HISPARSE_PATCHES)
    assert set(check_all(list(hp.HISPARSE_PATCHES))) == {p.target for p in hp.HISPARSE_PATCHES}
    for p in hp.HISPARSE_PATCHES:
        assert ".py:" in p.why and p.feature in ("cpu", "cpu_pd"), p.target
        assert callable(load_impl(p))


def test_mooncake_sender_takes_the_host_index_path_on_cpu(monkeypatch):
    sender = SimpleNamespace(supports_host_tensor_indices=True)
    hp.sender_host_indices_off(None, sender)
    assert sender.supports_host_tensor_indices is True  # not serving on CPU: untouched
    monkeypatch.setattr(hp, "serving_on_cpu", lambda: True)
    hp.sender_host_indices_off(None, sender)
    assert sender.supports_host_tensor_indices is False


def test_prefill_newest_entry_is_loaded_into_the_reserved_slot_once(gate, monkeypatch):
    """A long request admitted over PD (12 c4 entries > hot 4): its newest entry (position 11) resolves to the
    reserved slot 4, which nothing else loads. Each layer's first swap-in loads it from host, once; a short
    request (fast path, preloaded by sglang) records nothing."""
    monkeypatch.setattr(RUNTIME, "hisparse", HiSparseState())
    pool = _pool()
    hot = 4
    co = SimpleNamespace(
        is_dsv4_hisparse=True,
        device_buffer_size=hot,
        mem_pool_device=SimpleNamespace(kv_buffer=pool.device_buffers),
        host_token_len=lambda n: n // 4,
    )
    hp.admit_direct(None, co, SimpleNamespace(kv=SimpleNamespace(req_pool_idx=1, kv_allocated_len=48)))
    hp.admit_direct(None, co, SimpleNamespace(kv=SimpleNamespace(req_pool_idx=0, kv_allocated_len=16)))
    assert set(RUNTIME.hisparse.newest_pending) == {1}
    host_locs = torch.arange(100, 100 + 2 * 16, dtype=torch.int64).view(2, 16)
    dev_locs = torch.arange(2 * (hot + 64), dtype=torch.int32).view(2, hot + 64)
    args = (host_locs, dev_locs, torch.tensor([0, 1]), torch.tensor([4, 12]), hot, 2)
    assert hp.fill_newest(pool.kv_buffer[0], pool.device_buffers[0], *args) == 1
    assert _token(pool.device_buffers[0], int(dev_locs[1, hot])) == _token(pool.kv_buffer[0], 127)
    assert hp.fill_newest(pool.kv_buffer[0], pool.device_buffers[0], *args) == 0  # once per layer
    assert hp.fill_newest(pool.kv_buffer[1], pool.device_buffers[1], *args) == 1  # the other layer
    assert RUNTIME.hisparse.newest_pending == {}
    # a decode step already wrote a newer entry (position 12 >= the prefill's 12): the slot is left alone
    hp.admit_direct(None, co, SimpleNamespace(kv=SimpleNamespace(req_pool_idx=1, kv_allocated_len=48)))
    before = pool.device_buffers[0].clone()
    assert (
        hp.fill_newest(
            pool.kv_buffer[0],
            pool.device_buffers[0],
            host_locs,
            dev_locs,
            torch.tensor([1]),
            torch.tensor([13]),
            hot,
            1,
        )
        == 0
    )
    assert torch.equal(before, pool.device_buffers[0])
