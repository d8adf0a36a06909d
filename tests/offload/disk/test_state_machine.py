"""A hypothesis state machine over the three tiers (device-side reads via `get`, host page cache, page store):
admissions, decode rewrites, read-ahead, gets, finishes, cache pressure, injected disk faults (ENOSPC, EIO, torn
and corrupt writes) and read delays, with the read-ahead worker running.

Invariants after every step: the cache's own (`check`: bound except pinned pages, nothing lost, clean => on disk);
the live pages are exactly the model's; the store holds only live pages and its free list accounts for every
slot; at every get, the bytes equal the last bytes written, or the page is one whose disk copy the injector
damaged (then a `CorruptPageError` naming it, never other bytes).
"""

from __future__ import annotations

import errno
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flashmemory.offload.disk import CorruptPageError, FaultyFileOps, HostPageCache, PageStore
from flashmemory.offload.disk.store import _HDR, rid_digest

PB = 5000  # two 4-KiB blocks per slot: a torn write (first block only) loses the digest
SLOTS = 14
CACHE_PAGES = 3


def payload(rid: str, page: int, version: int) -> bytes:
    seed = (hash(rid) * 1000003 + page * 9176 + version * 31) & 0xFFFFFFFF
    return bytes((seed >> (8 * (j % 4)) ^ j) & 0xFF for j in range(PB))


class ThreeTiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="fm-disk-sm-")
        self.ops = FaultyFileOps()
        self.store = PageStore(self.dir, SLOTS * 8192, PB, ops=self.ops)
        self.cache = HostPageCache(self.store, CACHE_PAGES * PB)
        self.model: dict[tuple[str, int], bytes] = {}
        self.next_rid = 0
        self.version = 0

    def teardown(self) -> None:
        self.cache.close()
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------------------
    def rids(self) -> list[str]:
        return sorted({r for r, _ in self.model})

    def damaged_current(self, key: tuple[str, int]) -> bool:
        """Whether the store's current copy of `key` is one the injector tore or corrupted."""
        with self.store._lock:
            hit = self.store._map.get(key)
        if hit is None:
            return False
        for hdr in list(self.ops.damaged):
            _, _, rd, pg, seq, _ = _HDR.unpack(hdr[: _HDR.size])
            if (rd, pg, seq) == (rid_digest(key[0]), key[1], hit[1]):
                return True
        return False

    # -- rules -------------------------------------------------------------------------------------
    @rule(n=st.integers(1, 4))
    def admit(self, n: int) -> None:
        rid = f"req{self.next_rid}"
        self.next_rid += 1
        for p in range(n):
            self.version += 1
            data = payload(rid, p, self.version)
            self.cache.put(rid, p, data)
            self.model[(rid, p)] = data

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def rewrite(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.version += 1
        self.model[key] = payload(key[0], key[1], self.version)
        self.cache.put(key[0], key[1], self.model[key])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read_ahead(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.rids()))
        pages = sorted(p for r, p in self.model if r == rid)
        self.cache.prefetch(rid, data.draw(st.lists(st.sampled_from(pages), max_size=4)))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        try:
            got = bytes(self.cache.get(*key))
        except CorruptPageError as e:
            assert (e.rid, e.page) == key
            assert self.damaged_current(key), f"{key} reported corrupt but its disk copy was written intact"
            return
        assert got == self.model[key], f"{key}: bytes differ from the last write"

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.rids()))
        n = sum(1 for r, _ in self.model if r == rid)
        assert self.cache.free_request(rid) == n
        self.model = {k: v for k, v in self.model.items() if k[0] != rid}
        assert self.store.pages_of(rid) == set()

    @rule(on=st.booleans())
    def disk_full(self, on: bool) -> None:
        self.ops.plan.full = on

    @rule(code=st.sampled_from([errno.EIO, errno.ENOSPC]))
    def write_error(self, code: int) -> None:
        self.ops.plan.write_errors.append(code)

    @rule(kind=st.sampled_from(["tear", "corrupt"]))
    def damage_next_write(self, kind: str) -> None:
        setattr(self.ops.plan, kind, getattr(self.ops.plan, kind) + 1)

    @rule(delay=st.sampled_from([0.0, 0.001]))
    def slow_disk(self, delay: float) -> None:
        self.ops.plan.delay_s = delay

    @rule()
    def retry(self) -> None:
        self.cache.retry_pinned()

    # -- invariants ----------------------------------------------------------------------------------
    @invariant()
    def tiers_consistent(self) -> None:
        self.cache.check()  # holds with writes queued or in flight too
        assert self.cache.settle(), "the writer did not settle"
        live = self.cache.live_pages()
        assert {(r, p) for r, ps in live.items() for p in ps} == set(self.model), "a page was lost or invented"
        with self.cache._lock, self.store._lock:  # no write in flight while both locks are held
            assert set(self.store._map) <= set(self.model), "the store holds a finished request's page"
            assert self.store.used_slots == len(self.store._map), "a slot leaked"
            assert len(set(s for s, _ in self.store._map.values())) == len(self.store._map)


ThreeTiers.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestThreeTiers = ThreeTiers.TestCase
