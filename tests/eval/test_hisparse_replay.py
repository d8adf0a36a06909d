"""The HiSparse hot-buffer replay (flashmemory/eval/hisparse_replay.py): hand-worked sequences, and on random
top-k sequences the project's CPU swap-in op (ops/hisparse.py, what the live CPU server runs) driven side by side:
hits, misses and the buffer state (tokens per slot, LRU row) must agree exactly after every call."""

from __future__ import annotations

import random

import pytest
import torch

from flashmemory.eval.hisparse_replay import ITEM_BYTES, HotBufferReplay, ReplayStats, replay_hisparse
from flashmemory.sglang.cpu.ops import hisparse as hs


def _state(buf: HotBufferReplay) -> tuple[list[int], list[int]]:
    tokens, lru = buf.state()
    return tokens.tolist(), lru.tolist()


def test_item_bytes_is_the_ops_entry_size() -> None:
    assert ITEM_BYTES == hs.ITEM_BYTES


def test_worked_eviction_order() -> None:
    buf = HotBufferReplay(4)  # slot s holds position s, LRU 0,1,2,3
    # L=10: 9 is the newest (reserved slot), 2 hits slot 2, 7 misses into slot 0 (the oldest non-hit)
    assert buf.step([9, 2, 7], 10) == (2, 1)
    assert _state(buf) == ([7, 1, 2, 3], [1, 3, 0, 2])
    # 0 was evicted: it takes slot 1 (oldest non-hit), 7 hits slot 0, 5 takes slot 3;
    # new LRU = [unused evictables: 2] + [loaded in pick order: 1, 3] + [hits in old order: 0]
    assert buf.step([0, 7, 5], 10) == (1, 2)
    assert _state(buf) == ([7, 0, 2, 5], [2, 1, 3, 0])
    s = buf.stats()
    assert (s.calls, s.lookups, s.hits, s.misses, s.demand_transfer_ops) == (2, 6, 3, 3, 2)
    assert s.on_demand_bytes == 3 * 584 and s.hit_rate == 0.5


def test_hits_keep_their_old_order_at_the_mru_end() -> None:
    buf = HotBufferReplay(4)
    buf.step([3, 1], 10)  # hits 3 then 1, old order slots 1, 3
    assert _state(buf)[1] == [0, 2, 1, 3]
    buf.step([8, 0], 10)  # 8 takes slot 2 (oldest non-hit), 0 hits slot 0
    assert _state(buf) == ([0, 1, 8, 3], [1, 3, 2, 0])


def test_fast_path_counts_nothing_and_moves_nothing() -> None:
    buf = HotBufferReplay(8)
    before = _state(buf)
    assert buf.step([0, 5, 7], 8) == (0, 0)  # L <= slots
    assert _state(buf) == before
    s = buf.stats()
    assert (s.calls, s.fast_path_calls, s.lookups) == (1, 1, 0) and s.hit_rate == 1.0


def test_pd_admission_starts_empty_and_newest_is_the_reserved_slot() -> None:
    buf = HotBufferReplay(4, start_empty=True)
    assert buf.step([11, 0, 1], 12) == (1, 2)  # 11 = L-1 hits the reserved slot without a copy
    tokens, lru = _state(buf)
    assert tokens == [0, 1, -1, -1] and lru == [2, 3, 0, 1]
    assert 11 not in tokens  # the newest entry never takes an LRU slot
    assert buf.step([12, 11], 13) == (1, 1)  # one entry later, position 11 is an ordinary miss
    assert 11 in _state(buf)[0]


def test_bad_picks_are_refused() -> None:
    buf = HotBufferReplay(4)
    with pytest.raises(ValueError, match="outside"):
        buf.step([10], 10)
    with pytest.raises(ValueError, match="duplicate"):
        buf.step([3, 3], 10)


def test_prefetch_within_slots_minus_k_never_evicts_the_picks() -> None:
    slots, picks = 8, [20, 21, 22]
    buf = HotBufferReplay(slots, start_empty=True)
    buf.step(picks, 30)
    assert buf.prefetch(list(range(slots - len(picks))), 30) == 5  # H - k new positions
    assert buf.step(picks, 30) == (3, 0)
    assert buf.step([0, 1], 30) == (2, 0)  # prefetched, then picked
    s = buf.stats()
    assert (s.prefetched, s.prefetch_hits, s.prefetch_wasted, s.prefetch_unused_end) == (5, 2, 0, 3)
    assert s.prefetched_bytes == 5 * 584 and s.prefetch_transfer_ops == 1


def test_prefetch_beyond_slots_minus_k_evicts_a_pick() -> None:
    slots, picks = 8, [20, 21, 22]
    buf = HotBufferReplay(slots, start_empty=True)
    buf.step(picks, 30)
    assert buf.prefetch(list(range(slots - len(picks) + 1)), 30) == 6
    assert buf.step(picks, 30) == (2, 1)  # the oldest pick (20) was taken by the sixth position
    assert 20 in _state(buf)[0]


def test_prefetch_is_sanitized_and_skips_the_fast_path() -> None:
    buf = HotBufferReplay(4, start_empty=True)
    assert buf.prefetch([2, 2, 9, 10, -1, 3], 10) == 2  # 9 = L-1 and 10 are not backed up yet; 2 once
    assert sorted(t for t in _state(buf)[0] if t >= 0) == [2, 3]
    short = HotBufferReplay(4)
    assert short.prefetch([0, 1], 4) == 0 and short.stats().prefetch_calls == 0


def test_unused_prefetch_evicted_counts_as_wasted() -> None:
    buf = HotBufferReplay(4, start_empty=True)
    buf.prefetch([0], 10)
    buf.step([5, 6, 7, 8], 10)  # four misses take every slot, the prefetched one included
    assert buf.stats().prefetch_wasted == 1 and buf.stats().prefetch_unused_end == 0


def test_replay_sums_layers_caps_hints_and_checks_lengths() -> None:
    steps = [torch.tensor([9, 0, 1]), torch.tensor([10, 2, 3])]
    both = [steps, steps]
    s = replay_hisparse(both, [10, 11], slots=4)  # PD: starts empty
    assert (s.calls, s.hits, s.misses) == (4, 4, 8)  # per layer: the two newest hit, 0..3 miss
    local = replay_hisparse(both, [10, 11], slots=4, admission="local")
    assert (local.hits, local.misses) == (12, 0)  # 0..3 already resident
    hinted = replay_hisparse([steps], [10, 11], slots=4, hint={0: torch.tensor([2, 3, 4])})
    assert hinted.prefetched == 1 and hinted.prefetch_hits == 1 and hinted.misses == 3  # capped at 4 - 3
    assert replay_hisparse([steps], [10, 11], slots=4, hint={0: torch.tensor([2, 3])}, cap_hint=False).misses == 2
    with pytest.raises(ValueError, match="layer 0"):
        replay_hisparse([steps], [10], slots=4)
    assert replay_hisparse([], [], slots=4) == ReplayStats()


# ---- equivalence with the project's CPU swap-in op ------------------------------------------------------------


def _op_state(n_req: int, hot: int, max_len: int, empty: bool) -> dict[str, torch.Tensor]:
    width = hot + 64
    tokens = torch.full((n_req, width), -1, dtype=torch.int32)
    if not empty:
        tokens[:, :hot] = torch.arange(hot, dtype=torch.int32)
    pages = -(-n_req * max(width, max_len) // 64)
    return {
        "tokens": tokens,
        "locs": torch.arange(n_req * width, dtype=torch.int32).view(n_req, width),
        "host_locs": torch.arange(n_req * max_len, dtype=torch.int64).view(n_req, max_len),
        "lru": torch.arange(hot, dtype=torch.int16).repeat(n_req, 1),
        "host": torch.zeros(pages, hs.PAGE_BYTES, dtype=torch.uint8),
        "device": torch.zeros(pages, hs.PAGE_BYTES, dtype=torch.uint8),
    }


def _op_call(s: dict[str, torch.Tensor], rows: list[list[int]], lens: list[int], k: int, hot: int) -> hs.SwapInCounts:
    picks = torch.tensor(rows, dtype=torch.int32)
    out = torch.full((len(rows), k), -1, dtype=torch.int32)
    return hs.load_cache_to_device_buffer_dsv4(
        picks,
        s["tokens"],
        s["host_locs"],
        s["locs"],
        s["host"],
        s["device"],
        out,
        torch.arange(len(rows)),
        torch.tensor(lens),
        s["lru"],
        num_top_k=k,
        hot_buffer_size=hot,
    )


def _topk_walk(rnd: random.Random, prev: list[int], length: int, k: int, keep: float) -> list[int]:
    """A top-k-like pick list: part of the previous picks kept, the rest new; unique, < length, -1 padded
    when the history is shorter than k, the newest entry now and then."""
    kept = [p for p in prev if p < length and rnd.random() < keep]
    pool = [p for p in range(length) if p not in set(kept)]
    new = rnd.sample(pool, min(len(pool), k - len(kept)))
    row = (kept + new)[:k]
    if length - 1 not in row and rnd.random() < 0.3:
        row[rnd.randrange(len(row))] = length - 1
    rnd.shuffle(row)
    return row + [-1] * (k - len(row))


@pytest.mark.parametrize(
    "seed,hot,k,empty", [(0, 8, 4, True), (1, 8, 4, False), (2, 16, 6, True), (3, 12, 12, False), (4, 32, 8, True)]
)
def test_replay_equals_the_cpu_swap_in_op(seed: int, hot: int, k: int, empty: bool) -> None:
    """Two requests per call, lengths growing through the fast path into the slow one, prefetch calls of at most
    hot - k positions between steps: every call's counts and the state of both requests agree exactly."""
    rnd = random.Random(seed)
    n_req, steps, max_len = 2, 60, 4 * hot
    s = _op_state(n_req, hot, max_len, empty)
    bufs = [HotBufferReplay(hot, start_empty=empty) for _ in range(n_req)]
    lens = [hot - 2, hot + 1]
    prev: list[list[int]] = [[], []]
    for _ in range(steps):
        lens = [min(max_len, n + (rnd.random() < 0.4)) for n in lens]
        rows = [_topk_walk(rnd, prev[r], lens[r], k, keep=0.6) for r in range(n_req)]
        prev = rows
        c = _op_call(s, rows, lens, k, hot)
        got = [bufs[r].step(rows[r], lens[r]) for r in range(n_req)]
        assert (c.hits, c.misses) == tuple(map(sum, zip(*got)))
        if rnd.random() < 0.5:  # a hint: positions < L-1, unique, at most hot - k, through the same op
            w = hot - k
            hints = [rnd.sample(range(n - 1), min(w, n - 1)) for n in lens]
            loaded = [bufs[r].prefetch(hints[r], lens[r]) for r in range(n_req)]
            if w:
                ch = _op_call(s, [h + [-1] * (w - len(h)) for h in hints], lens, w, hot)
                assert ch.misses == sum(loaded)
        for r in range(n_req):
            assert _state(bufs[r]) == (s["tokens"][r, :hot].tolist(), s["lru"][r].tolist())
    total = sum((b.stats() for b in bufs), ReplayStats())
    assert total.misses > 0 and total.hits > 0 and total.fast_path_calls > 0
