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


# ---- a live trace (FLASHMEMORY_HISPARSE_TRACE) replayed --------------------------------------------------------


def test_trace_of_the_patched_swap_in_replays_exactly(tmp_path, monkeypatch) -> None:
    """The CPU server's swap-in hook (patches_hisparse.swap_in_dsv4, gate on) writes a trace of two c4 layers and
    two requests, one admitted empty over PD and one at 0..H-1, a request slot reused after a new admission; the
    replay of the trace gives the hook's own counts call by call, and the totals its counter kept."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from flashmemory.sglang.cpu import patches_hisparse as hp

    trace = tmp_path / "trace.jsonl"
    counter = hp.SwapInCounter()
    counter.prom = {}
    monkeypatch.setattr(hp, "hisparse_on_cpu", lambda: True)
    from flashmemory.sglang.context import HiSparseState
    from flashmemory.sglang.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "hisparse", HiSparseState(swapin=counter, trace_path=str(trace)))
    hot, k, max_len, rnd = 8, 6, 40, random.Random(7)
    layers = [_op_state(2, hot, max_len, empty=False) for _ in range(2)]
    coord = SimpleNamespace(
        is_dsv4_hisparse=True,
        device_buffer_size=hot,
        host_token_len=lambda n: n // 4,
        mem_pool_device=SimpleNamespace(kv_buffer=[]),
    )

    def admit(rid: int, compressed: int) -> None:
        hp.admit_direct(
            None, coord, SimpleNamespace(kv=SimpleNamespace(req_pool_idx=rid, kv_allocated_len=4 * compressed))
        )
        for s in layers:  # what sglang does at admission: 0..H-1, or empty for a long PD request
            s["tokens"][rid, :hot] = -1 if compressed > hot else torch.arange(hot, dtype=torch.int32)
            s["lru"][rid] = torch.arange(hot, dtype=torch.int16)

    admit(0, 20)
    admit(1, 6)
    lens, prev = [20, 6], [[], []]
    for step in range(40):
        if step == 20:
            admit(0, 30)  # slot 0 finished and was given to a new long request
            lens[0], prev[0] = 30, []
        lens = [min(max_len, n + (rnd.random() < 0.5)) for n in lens]
        rows = [_topk_walk(rnd, prev[r], lens[r], k, keep=0.7) for r in range(2)]
        prev = rows
        for s in layers:
            out = torch.full((2, k), -1, dtype=torch.int32)
            hp.swap_in_dsv4(
                None,
                torch.tensor(rows, dtype=torch.int32),
                s["tokens"],
                s["host_locs"],
                s["locs"],
                s["host"],
                s["device"],
                out,
                torch.arange(2),
                torch.tensor(lens),
                s["lru"],
                584,
                k,
                hot,
            )
    from flashmemory.eval.hisparse_trace import replay_trace

    got = replay_trace(str(trace))
    live = counter.snapshot()
    assert got.mismatched_calls == 0 and (got.layers, got.requests, got.recorded_hot) == (2, 2, hot)
    assert got.recorded["calls"] == live["calls"] == 80
    assert (got.replayed.lookups, got.replayed.hits, got.replayed.misses) == (
        live["lookups"],
        live["hits"],
        live["misses"],
    ) and live["misses"] > 0
    bigger = replay_trace(str(trace), slots=2 * hot)
    assert bigger.slots == 2 * hot and bigger.replayed.misses < got.replayed.misses


def test_trace_is_off_by_default_and_a_relative_path_is_refused(tmp_path) -> None:
    from flashmemory.env import EnvError, hisparse_trace

    assert hisparse_trace({}) == ""
    assert hisparse_trace({"FLASHMEMORY_HISPARSE_TRACE": str(tmp_path / "t")}) == str(tmp_path / "t")
    with pytest.raises(EnvError, match="FLASHMEMORY_HISPARSE_TRACE"):
        hisparse_trace({"FLASHMEMORY_HISPARSE_TRACE": "t.jsonl"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    from flashmemory.eval.hisparse_trace import replay_trace

    with pytest.raises(ValueError, match="bad.jsonl:1"):
        replay_trace(str(bad))


def test_main_prints_one_line_per_buffer_size(tmp_path, capsys) -> None:
    import json

    from flashmemory.eval.hisparse_trace import main

    trace = tmp_path / "t.jsonl"
    lines = [
        {"ev": "admit", "rid": 3, "empty": True},
        {
            "ev": "swapin",
            "layer": 0,
            "hot": 4,
            "k": 3,
            "rows": [[3, 10, [9, 0, 1]]],
            "lookups": 3,
            "hits": 1,
            "misses": 2,
        },
        {
            "ev": "swapin",
            "layer": 0,
            "hot": 4,
            "k": 3,
            "rows": [[3, 11, [10, 0, 2]]],
            "lookups": 3,
            "hits": 2,
            "misses": 2,
        },
    ]  # the live op said 2 hits; the replay gives 2 (10, 0)
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main([str(trace), "4", "2"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [o["slots"] for o in out] == [4, 2]
    assert out[0]["recorded"] == {"calls": 2, "lookups": 6, "hits": 3, "misses": 4}
    assert (out[0]["replayed"]["hits"], out[0]["replayed"]["misses"], out[0]["mismatched_calls"]) == (3, 3, 1)
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err
    assert main([str(trace), "zero"]) == 2


def test_trace_admission_follows_the_replayed_size(tmp_path) -> None:
    """A request whose prefill brought 10 c4 entries starts empty under a 4-slot buffer but preloaded (slot s =
    position s) under a 12-slot one, as sglang's admission decides by the buffer size."""
    import json

    from flashmemory.eval.hisparse_trace import replay_trace

    trace = tmp_path / "t.jsonl"
    lines = [
        {"ev": "admit", "rid": 0, "entries": 10, "empty": True},
        {"ev": "swapin", "layer": 0, "hot": 4, "k": 2, "rows": [[0, 13, [0, 1]]], "lookups": 2, "hits": 0, "misses": 2},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert replay_trace(str(trace)).replayed.misses == 2
    assert replay_trace(str(trace), slots=12).replayed.hits == 2


def test_trace_oracle_prefetches_the_next_step_of_the_same_request(tmp_path) -> None:
    """--oracle: after each step, the same layer's next picks of the same request (at most slots - k) are
    prefetched; a new admission of the slot ends the request, so its picks are not hinted across it."""
    import json
    import subprocess
    import sys

    from flashmemory.eval.hisparse_trace import replay_trace

    trace = tmp_path / "t.jsonl"

    def call(picks: list[int]) -> dict:
        return {
            "ev": "swapin",
            "layer": 0,
            "hot": 4,
            "k": 2,
            "rows": [[0, 20, picks]],
            "lookups": 2,
            "hits": 0,
            "misses": 2,
        }

    lines = [
        {"ev": "admit", "rid": 0, "entries": 19, "empty": True},
        call([0, 1]),
        call([2, 3]),
        call([4, 5]),
        {"ev": "admit", "rid": 0, "entries": 19, "empty": True},
        call([6, 7]),
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    plain = replay_trace(str(trace)).replayed
    assert (plain.misses, plain.prefetched) == (8, 0)
    hinted = replay_trace(str(trace), oracle=True).replayed
    assert (hinted.misses, hinted.prefetched, hinted.prefetch_hits) == (4, 4, 4)  # [6, 7] not hinted: new request
    done = subprocess.run(
        [sys.executable, "-m", "flashmemory.eval.hisparse_trace", str(trace), "--oracle"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["replayed"]["prefetch_hits"] == 4
