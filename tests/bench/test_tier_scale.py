"""`bench tier-scale` counts read-ahead hits, cache hits and recalls/cycles that waited for disk with the engine's
definitions: checked with a cache that reads ahead at once (no threads, so no timing decides a count), one large
enough for a cycle's picks and one too small; then one threaded run end to end (no timing asserted)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from flashmemory.bench import tier_scale as ts
from flashmemory.errors import UserError
from flashmemory.offload.disk import HostPageCache, PageStore


def _args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ts.add_args(p)
    a = p.parse_args(["--quick", *flags])
    ts._defaults(a)
    return a


def _filled(tmp_path, a: argparse.Namespace, cache_pages: int) -> tuple[PageStore, HostPageCache]:
    need = ts.planned_bytes(a)
    store = PageStore(str(tmp_path), need["disk"], need["page"], direct=False)
    cache = HostPageCache(store, cache_pages * need["page"], worker=False)
    base = np.arange(need["page"], dtype=np.int64).astype(np.uint8)
    for r in range(a.requests):
        for p in range(a.pages):
            cache.put(f"req{r}", p, memoryview(ts.page_bytes_of(r, p, base)))
    cache.flush()
    cache.drop_clean()
    return store, cache


def test_read_ahead_that_lands_is_a_hit_and_nothing_waits(tmp_path) -> None:
    a = _args("--requests", "4", "--pages", "12", "--kmax", "3", "--cycles", "4", "--turnover", "0.5")
    store, cache = _filled(tmp_path, a, cache_pages=4 * 3 * 2)  # a cycle's 12 picks fit, with last cycle's
    try:
        t = ts.run_cycles(cache, a, 0.0, np.empty((a.kmax, store.page_bytes), dtype=np.uint8))
    finally:
        cache.close()
        store.close()
    assert (t.cycles, t.recalls, t.gets) == (4, 16, 48)
    assert t.ahead >= 12 and t.ahead_hits == t.ahead  # the first cycle's picks were all cold, all landed
    assert t.hits == t.gets and t.recalls_waited == t.cycles_waited == 0
    assert t.rates() == {
        "cache_hit_rate": 1.0,
        "readahead_hit_rate": 1.0,
        "recalls_waited_share": 0.0,
        "cycles_waited_share": 0.0,
    }
    assert cache.counters.disk_bytes_read == t.ahead * store.page_bytes


def test_a_cache_smaller_than_a_cycle_makes_recalls_wait(tmp_path) -> None:
    a = _args("--requests", "4", "--pages", "12", "--kmax", "3", "--cycles", "3", "--turnover", "1")
    store, cache = _filled(tmp_path, a, cache_pages=3)  # each request's read-ahead evicts the one before
    try:
        t = ts.run_cycles(cache, a, 0.0, np.empty((a.kmax, store.page_bytes), dtype=np.uint8))
    finally:
        cache.close()
        store.close()
    assert t.cycles_waited == t.cycles == 3
    assert t.recalls_waited >= 3 * (a.requests - 1)  # only the last request's read-ahead survives until its copy
    assert t.hits < t.gets and t.ahead_hits < t.ahead
    assert t.rates()["cache_hit_rate"] == t.hits / t.gets and t.rates()["cycles_waited_share"] == 1.0
    assert cache.counters.cache_hits == t.hits and cache.counters.cache_misses == t.gets - t.hits


def test_picks_keep_the_share_not_turned_over() -> None:
    rng = np.random.default_rng(0)
    first = ts.picks(rng, 20, 8, 0.25, [])
    assert len(set(first)) == 8 and all(0 <= p < 20 for p in first)
    again = ts.picks(rng, 20, 8, 0.25, first)
    assert again[:6] == first[:6] and len(set(again)) == 8
    assert ts.picks(rng, 20, 8, 0.0, first) == first


def test_threaded_run_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "scale.json"
    a = _args(
        "--requests",
        "3",
        "--pages",
        "6",
        "--kmax",
        "2",
        "--cycles",
        "2",
        "--lead-ms",
        "0",
        "5",
        "--json",
        str(out),
        "--dir",
        str(tmp_path),
    )
    assert ts.run(a) == 0
    assert "read-ahead hit" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["history_bytes"] == 18 * r["page_bytes"] and [x["lead_ms"] for x in r["runs"]] == [0, 5]
    for x in r["runs"]:
        assert x["gets"] == 2 * 3 * 2 and x["counters"]["cache_hits"] == x["hits"]
        assert 0 <= x["readahead_hit_rate"] <= 1 and x["counters"]["corrupt_pages"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scale.json"]  # the store file is gone


@pytest.mark.parametrize(
    "flags, msg",
    [
        (["--kmax", "20", "--pages", "4"], "--kmax 20: must be <= --pages 4"),
        (["--turnover", "1.5"], "--turnover 1.5: must lie in [0, 1]"),
        (["--layers", "3"], "--layers 3: must be >= 4"),
        (["--dir", "/nonexistent/x"], "--dir '/nonexistent/x' is not an existing directory"),
    ],
)
def test_bad_flags_name_the_flag(flags: list[str], msg: str) -> None:
    with pytest.raises(UserError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        ts._check(_args(*flags))


def test_registered_and_fails_in_one_line(capsys) -> None:
    from flashmemory.cli import main

    assert main(["bench", "tier-scale", "--kmax", "30", "--pages", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "flashmemory bench tier-scale: error: --kmax 30: must be <= --pages 4 (a request recalls pages it holds)"
    )
