"""The disk-tier benches' scratch store (flashmemory/bench/tier_store.py): an owned temporary directory is removed
at teardown and a given one kept; a page that never reached the disk is refused with --dir named."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from flashmemory.bench.tier_store import check_written, close_store, store_dir
from flashmemory.errors import UserError


def _cache(pinned: int, errors: int) -> SimpleNamespace:
    calls: list[str] = []
    return SimpleNamespace(
        pinned_pages=pinned,
        counters=SimpleNamespace(write_errors=errors),
        flush=lambda: calls.append("flush"),
        close=lambda: calls.append("close"),
        calls=calls,
    )


def test_owned_dir_is_removed_and_a_given_one_kept(tmp_path):
    d, own = store_dir(None, "fm-test-tier-store-")
    assert own and os.path.isdir(d)
    store = SimpleNamespace(close=lambda: None)
    cache = _cache(0, 0)
    close_store(cache, store, d, own)
    assert not os.path.exists(d) and cache.calls == ["close"]
    given, own = store_dir(str(tmp_path), "unused-")
    assert (given, own) == (str(tmp_path), False)
    close_store(None, store, given, own)
    assert tmp_path.is_dir()


@pytest.mark.parametrize("pinned,errors", [(2, 0), (0, 3)])
def test_unwritten_pages_are_refused(pinned, errors):
    cache = _cache(pinned, errors)
    with pytest.raises(UserError, match=rf"--dir /x: {pinned} of 10 pages .*\({errors} write errors.*; why$"):
        check_written(cache, "/x", 10, "; why")
    assert cache.calls == ["flush"]
    ok = _cache(0, 0)
    check_written(ok, "/x", 10)
    assert ok.calls == ["flush"]
