"""The torch HiSparse ops (flashmemory/sglang/cpu/ops/hisparse.py) against hand-worked cases and, on random
traces, against the plain-Python hot-buffer model in hisparse_reference.py: outputs, LRU order, slot contents,
device bytes and hit/miss counts must agree exactly."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmemory.sglang.cpu.ops import hisparse as hs
from tests.sglang.cpu import hisparse_reference as ref

PAD = 64  # sglang's padded buffer: hot + one c4 page


def _cache(pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages, hs.PAGE_BYTES), dtype=torch.uint8, generator=g)


def _state(n_req: int, hot: int, max_len: int, empty: bool, seed: int):
    """Buffers for n_req request slots: device locs shuffled over the device pool, host locs shuffled too."""
    rnd = random.Random(seed)
    width = hot + PAD
    dev_locs = list(range(n_req * width))
    rnd.shuffle(dev_locs)
    host = list(range(n_req * max_len))
    rnd.shuffle(host)
    s = {
        "tokens": torch.full((n_req, width), -1, dtype=torch.int32),
        "locs": torch.tensor(dev_locs, dtype=torch.int32).view(n_req, width),
        "host_locs": torch.tensor(host, dtype=torch.int64).view(n_req, max_len),
        "lru": torch.arange(hot, dtype=torch.int16).repeat(n_req, 1),
        "host": _cache(-(-n_req * max_len // 64), seed),
        "device": torch.zeros(-(-n_req * width // 64), hs.PAGE_BYTES, dtype=torch.uint8),
    }
    if not empty:  # alloc_device_buffer: slot i holds position i
        s["tokens"][:, :hot] = torch.arange(hot, dtype=torch.int32)
    return s


def _call(s, picks, rids, lens, out, k, hot, real=None):
    return hs.load_cache_to_device_buffer_dsv4(
        torch.tensor(picks, dtype=torch.int32),
        s["tokens"],
        s["host_locs"],
        s["locs"],
        s["host"],
        s["device"],
        out,
        torch.tensor(rids),
        torch.tensor(lens),
        s["lru"],
        num_top_k=k,
        hot_buffer_size=hot,
        num_real_reqs=real,
    )


def test_worked_example_lru_order_and_counts():
    hot, k = 4, 3
    s = _state(1, hot, 16, empty=False, seed=0)
    loc = s["locs"][0].tolist()
    out = torch.full((1, k), 7, dtype=torch.int32)
    c = _call(s, [[9, 2, 7]], [0], [10], out, k, hot)
    # 9 is the newest (reserved slot 4), 2 hits slot 2, 7 misses and takes slot 0, the oldest non-hit
    assert out[0].tolist() == [loc[4], loc[2], loc[0]]
    assert s["lru"][0].tolist() == [1, 3, 0, 2]
    assert s["tokens"][0, :hot].tolist() == [7, 1, 2, 3]
    assert (c.lookups, c.hits, c.misses, c.bytes_h2d) == (3, 2, 1, 584)
    c = _call(s, [[0, 7, 5]], [0], [10], out, k, hot)
    # 0 was evicted: miss -> slot 1 (oldest non-hit); 7 hits slot 0; 5 miss -> slot 3
    assert out[0].tolist() == [loc[1], loc[0], loc[3]]
    assert s["lru"][0].tolist() == [2, 1, 3, 0]
    assert s["tokens"][0, :hot].tolist() == [7, 0, 2, 5]
    assert (c.hits, c.misses) == (1, 2)
    # the copied bytes are the host tokens of positions 0, 5 and 7
    for pos, slot in ((0, 1), (5, 3), (7, 0)):
        h = hs.token_byte_offsets(s["host_locs"][0, pos : pos + 1])
        d = hs.token_byte_offsets(torch.tensor([loc[slot]]))
        assert torch.equal(s["device"].view(-1)[d], s["host"].view(-1)[h])


def test_fast_path_padded_rows_and_unwritten_minus_one():
    hot, k = 4, 3
    s = _state(3, hot, 16, empty=False, seed=1)
    out = torch.full((3, k), 99, dtype=torch.int32)
    # req 0 short (L=3 <= hot): direct lookup; req 1 L=2: only the first 2 picks count; row 2 is padding
    c = _call(s, [[2, -1, 0], [1, 0, 1], [0, 1, 2]], [0, 1, 2], [3, 2, 9], out, k, hot, real=2)
    l0, l1 = s["locs"][0].tolist(), s["locs"][1].tolist()
    assert out[0].tolist() == [l0[2], -1, l0[0]]
    assert out[1].tolist() == [l1[1], l1[0], -1]
    assert out[2].tolist() == [-1, -1, -1]
    assert (c.lookups, c.misses) == (0, 0) and int(s["device"].sum()) == 0
    assert s["lru"].tolist() == [[0, 1, 2, 3]] * 3
    # long sequence: a -1 pick is taken as a hit and its output entry keeps whatever it held
    out[:] = 55
    _call(s, [[-1, 8, 3]], [2], [9], out, k, hot)
    assert out[0, 0] == 55 and out[0, 1] == s["locs"][2, hot] and out[0, 2] == s["locs"][2, 3]


def test_token_copy_layout_and_transfer_across_layers():
    src = [_cache(3, 10), _cache(3, 11)]
    dst = [torch.zeros(3, hs.PAGE_BYTES, dtype=torch.uint8) for _ in range(2)]
    hs.transfer_cache_dsv4(src, dst, torch.tensor([65, 3]), torch.tensor([1, 130]))
    for s, d in zip(src, dst):
        # token 65 = page 1, slot 1: value at 37440 + 576, scale at 37440 + 36864 + 8
        assert torch.equal(d[0, 576:1152], s[1, 576:1152]) and torch.equal(d[0, 36872:36880], s[1, 36872:36880])
        assert torch.equal(d[2, 2 * 576 : 3 * 576], s[0, 3 * 576 : 4 * 576])
        assert int((d != 0).sum()) <= 2 * 584 and int(d[1].sum()) == 0
        # the same bytes the reference layout names
        ref_src, ref_dst = bytearray(s.numpy().tobytes()), bytearray(3 * ref.PAGE)
        ref.copy_token(ref_src, ref_dst, 65, 1)
        ref.copy_token(ref_src, ref_dst, 3, 130)
        assert bytes(ref_dst) == d.numpy().tobytes()


def test_bad_input_is_named():
    s = _state(1, 4, 16, empty=True, seed=2)
    out = torch.zeros(1, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="hot_buffer_size"):
        _call(s, [[1, 2, 3, 4, 5]], [0], [10], out, 5, 4)
    s["host_locs"][0, 6] = -1  # no host backup of position 6
    with pytest.raises(ValueError, match="src_locs"):
        _call(s, [[6, 1]], [0], [10], out, 2, 4)
    with pytest.raises(ValueError, match="uint8"):
        hs.copy_c4_tokens(torch.zeros(2, 10), s["device"], torch.tensor([0]), torch.tensor([0]))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    hot=st.integers(2, 12),
    k_frac=st.floats(0.1, 1.0),
    n_req=st.integers(1, 3),
    steps=st.integers(1, 8),
    empty=st.booleans(),
)
def test_random_traces_match_the_reference(seed, hot, k_frac, n_req, steps, empty):
    rnd = random.Random(seed)
    k = max(1, int(hot * k_frac))
    max_len = 3 * hot + 8
    s = _state(n_req, hot, max_len, empty, seed)
    host_bytes = bytearray(s["host"].numpy().tobytes())
    dev_bytes = bytearray(s["device"].numpy().tobytes())
    models = [ref.RefHotBuffer(hot, s["locs"][r].tolist(), s["tokens"][r].tolist()) for r in range(n_req)]
    lens = [rnd.randint(1, max_len) for _ in range(n_req)]
    out = torch.full((n_req, k), -7, dtype=torch.int32)
    for _ in range(steps):
        rids = rnd.sample(range(n_req), rnd.randint(1, n_req))
        real = rnd.randint(1, len(rids))
        picks = []
        for r in rids:
            lens[r] = min(max_len, lens[r] + rnd.randint(0, 2))
            p = rnd.sample(range(lens[r]), min(k, lens[r]))
            p = [x if rnd.random() > 0.1 else -1 for x in p] + [-1] * (k - len(p))
            rnd.shuffle(p)
            picks.append(p)
        prev = out.tolist()
        c = _call(s, picks, rids, [lens[r] for r in rids], out, k, hot, real)
        want_hits = want_miss = 0
        for b, r in enumerate(rids):
            if b >= real:
                assert out[b].tolist() == [-1] * k
                continue
            m = models[r]
            h0, m0 = m.hits, m.misses
            want = m.step(picks[b], lens[r], s["host_locs"][r].tolist(), host_bytes, dev_bytes, prev[b])
            want_hits, want_miss = want_hits + m.hits - h0, want_miss + m.misses - m0
            assert out[b].tolist() == want
            if lens[r] > hot:
                assert s["lru"][r].tolist() == m.lru
            assert s["tokens"][r, :hot].tolist() == m.slot_token[:hot]
        assert (c.hits, c.misses, c.bytes_h2d) == (want_hits, want_miss, 584 * want_miss)
        assert s["device"].numpy().tobytes() == bytes(dev_bytes)
