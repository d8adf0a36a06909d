"""The HiSparse prefetch on the torch swap-in op: the invariants that keep sglang's outputs exact (the step's picks
survive a prefetch of at most H-K positions, only real bytes are marked resident, rows stay permutations, locs
never move, fast-path and padded rows are left alone) and the attribution of prefetch hits."""

from __future__ import annotations

import random

import torch

from flashmemory.sglang.cpu.ops import hisparse as hs
from flashmemory.sglang.cpu.ops.hisparse_prefetch import Provenance, dedup_positions, prefetch_layer_cpu, sanitize_hint
from tests.sglang.cpu.test_hisparse_ops import _call, _state

HOT, K, MAXLEN = 64, 16, 400


def _prefetch(s, hint, rids, lens, real=None):
    hint = torch.tensor(hint, dtype=torch.int32)
    scratch = torch.full(hint.shape, -7, dtype=torch.int32)
    return prefetch_layer_cpu(
        hint,
        s["tokens"],
        s["host_locs"],
        s["locs"],
        s["host"],
        s["device"],
        scratch,
        torch.tensor(rids),
        torch.tensor(lens),
        s["lru"],
        HOT,
        len(rids) if real is None else real,
    )


def _resident(s, rid):
    return set(s["tokens"][rid, :HOT].tolist()) - {-1}


def _bytes_ok(s, rid, out_row, picks):
    """Every pick's output loc holds the host bytes of that position (what attention reads is right)."""
    for loc, p in zip(out_row.tolist(), picks):
        d = hs.token_byte_offsets(torch.tensor([loc]))
        h = hs.token_byte_offsets(s["host_locs"][rid, p : p + 1])
        if not torch.equal(s["device"].view(-1)[d], s["host"].view(-1)[h]):
            return False
    return True


def test_h_minus_k_positions_keep_every_current_pick_and_more_evict_them():
    picks = list(range(300, 316))
    for extra, evicted in ((0, 0), (8, 8)):
        s = _state(1, HOT, MAXLEN, empty=True, seed=1)
        out = torch.zeros((1, K), dtype=torch.int32)
        _call(s, [picks], [0], [350], out, K, HOT)
        hint = list(range(100, 100 + HOT - K + extra))  # disjoint from the picks
        c = _prefetch(s, [hint], [0], [350])
        assert c.loaded == HOT - K + extra and c.bytes_h2d == c.loaded * hs.ITEM_BYTES
        assert len(set(picks) - _resident(s, 0)) == evicted
        again = _call(s, [picks], [0], [350], out, K, HOT)
        assert again.misses == evicted and _bytes_ok(s, 0, out[0], picks)


def test_sanitize_drops_newest_past_end_negative_and_hostless_positions():
    host = torch.arange(2 * 20, dtype=torch.int64).view(2, 20)
    host[1, 5] = -1
    hint = torch.tensor([[3, 9, 10, -1, 25], [5, 4, 8, 0, 19]], dtype=torch.int32)
    clean = sanitize_hint(hint, torch.tensor([0, 1]), torch.tensor([11, 30]), host)
    # row 0: L=11 -> 10 is the newest (L-1), 25 is past L; row 1: 5 has no host loc, 19 < L-1 and inside the table
    assert clean.tolist() == [[3, 9, -1, -1, -1], [-1, 4, 8, 0, 19]]
    assert clean.dtype == torch.int32


def test_a_hint_without_host_bytes_changes_no_state():
    s = _state(1, HOT, MAXLEN, empty=True, seed=2)
    out = torch.zeros((1, K), dtype=torch.int32)
    _call(s, [list(range(200, 216))], [0], [350], out, K, HOT)
    s["host_locs"][0, 100:110] = -1
    before = {k: s[k].clone() for k in ("tokens", "lru", "device")}
    c = _prefetch(s, [list(range(100, 110)) + [349, 360, -1]], [0], [350])
    assert (c.loaded, c.listed, c.dropped) == (0, 0, 12)
    for k, v in before.items():
        assert torch.equal(s[k], v), k


def test_dedup_keeps_first_occurrence_order_and_the_cap():
    assert dedup_positions(torch.tensor([7, 3, 7, -1, 5, 3, 9]), 10).tolist() == [7, 3, 5, 9]
    assert dedup_positions(torch.tensor([7, 3, 7, 5]), 2).tolist() == [7, 3]
    assert dedup_positions(torch.tensor([4, 4]), 0).numel() == 0


def test_fast_path_and_padded_rows_are_left_alone():
    s = _state(3, HOT, MAXLEN, empty=False, seed=3)
    before = {k: s[k].clone() for k in ("tokens", "lru", "device")}
    # row 0: fast path (L <= H); row 2 is padding (real = 2); row 1 is real and long
    c = _prefetch(s, [[1, 2, 3], [100, 101, 102], [150, 151, 152]], [0, 1, 2], [HOT, 300, 300], real=2)
    assert c.loaded == 3
    assert torch.equal(s["tokens"][0], before["tokens"][0]) and torch.equal(s["lru"][0], before["lru"][0])
    assert torch.equal(s["tokens"][2], before["tokens"][2]) and torch.equal(s["lru"][2], before["lru"][2])
    assert torch.equal(s["locs"], _state(3, HOT, MAXLEN, empty=False, seed=3)["locs"])  # locs never move


def test_attribution_counts_used_wasted_and_released_marks():
    s = _state(2, HOT, MAXLEN, empty=True, seed=4)
    prov = Provenance(1, 2, HOT + 64)
    out = torch.zeros((1, K), dtype=torch.int32)
    _call(s, [list(range(300, 316))], [0], [350], out, K, HOT)
    before = s["tokens"][[0]].clone()
    _prefetch(s, [list(range(100, 140))], [0], [350])
    assert prov.after_prefetch(0, before, torch.tensor([0]), s["tokens"], 1) == 0
    assert int((prov.marks[0, 0] >= 0).sum()) == 40
    picks = list(range(100, 110)) + list(range(200, 206))  # 10 prefetched, 6 new
    _call(s, [picks], [0], [350], out, K, HOT)
    a = prov.after_demand(0, torch.tensor([picks]), torch.tensor([0]), s["tokens"], 1)
    assert (a.used, a.wasted) == (10, 0)
    # 48 new picks: the 18 oldest slots, then the 30 prefetched entries nobody used
    wasted = 0
    for i in range(3):
        picks = list(range(10 + 16 * i, 26 + 16 * i))
        _call(s, [picks], [0], [350], out, K, HOT)
        a = prov.after_demand(0, torch.tensor([picks]), torch.tensor([0]), s["tokens"], 1)
        wasted += a.wasted
        assert a.used == 0
    assert wasted == 30 and int((prov.marks >= 0).sum()) == 0
    before = s["tokens"][[1]].clone()
    _prefetch(s, [list(range(0, 5))], [1], [350])
    assert prov.after_prefetch(0, before, torch.tensor([1]), s["tokens"], 1) == 0
    assert prov.release(1) == 5 and int((prov.marks >= 0).sum()) == 0


def test_random_traces_with_prefetch_read_the_right_bytes_and_keep_permutations():
    """Demand steps interleaved with random hints (duplicates, bad positions, up to H-K per row): every step's
    output reads its picks' host bytes (outputs equal stock's), LRU rows stay permutations of 0..H-1, and the
    hint lowers the demand misses against the same trace without it."""
    rnd = random.Random(5)
    trace = []
    for t in range(30):
        lens = [300 + t, 330 + t]
        trace.append([sorted(rnd.sample(range(0, l - 1), K)) for l in lens])
    misses = {}
    for with_hint in (False, True):
        s = _state(2, HOT, MAXLEN, empty=True, seed=6)
        out = torch.zeros((2, K), dtype=torch.int32)
        total = 0
        for t, picks in enumerate(trace):
            lens = [300 + t, 330 + t]
            c = _call(s, picks, [0, 1], lens, out, K, HOT)
            total += c.misses
            for b in range(2):
                assert _bytes_ok(s, b, out[b], picks[b])
                assert sorted(s["lru"][b].tolist()) == list(range(HOT))
            if with_hint and t + 1 < len(trace):
                hint = [
                    dedup_positions(
                        torch.tensor(trace[t + 1][b] + [lens[b] - 1, 999, trace[t + 1][b][0]]), HOT - K
                    ).tolist()
                    for b in range(2)
                ]
                width = max(map(len, hint))
                _prefetch(s, [h + [-1] * (width - len(h)) for h in hint], [0, 1], lens)
        misses[with_hint] = total
    assert misses[True] < misses[False] / 4, misses
