"""Shrink mode's DRAM cap on queued requests (SGLANG_PATHP_HOST_MIRROR_GB with the disk tier), on sglang's real
`DeepSeekV4TokenToKVPool` built on CPU, no server.

PD lands three requests' KV in the sparse mirror; they wait in the decode queue (one runs next). Past the cap the
adapter's `queue_gate` parks the queue's tail in the tier on a worker (mincore: their DRAM goes back), holds a
parked request back when it is next while its pages are read back from disk, then lets it run: its admission's
warm start reads the restored bytes and every resident pick is exact, with pages read from disk and no decode-
thread disk wait. A read error or a checksum mismatch while reading back fails that request alone (refused at
admission, named with its page); the others run exact. And the gate's Patch row holds such a request back from
sglang's own `_get_new_prebuilt_batch`, then puts it back at the queue's front.
"""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest
import torch

from flashmemory.offload import check_invariants
from flashmemory.offload.disk import FaultyFileOps
from flashmemory.offload.disk.queued import PARKED, READY
from flashmemory.offload.disk.sparse_mirror import resident_bytes
from flashmemory.sglang.decode import queue_gate
from flashmemory.sglang.decode.runtime import RUNTIME
from tests.sglang.decode import test_shrink_adapter
from tests.sglang.decode.test_shrink_adapter import PAGE
from tests.sglang.decode.test_shrink_disk_tier import PdDecode

pytestmark = pytest.mark.sglang
sa = test_shrink_adapter.sa
CAP_GB = 0.0002  # 200 KB: two 83,200-B disk pages of this pool; the three requests land 15 pages
REQS = {"a": ([9, 3, 40, 17, 22, 5], 5 * PAGE + 200), "b": ([11, 2, 50, 7, 31], 4 * PAGE + 12)}
REQS["c"] = ([12, 4, 41, 18], 3 * PAGE + 100)


class Queue(PdDecode):
    """`PdDecode` whose requests land, then wait in a decode queue (req_pool_idx = position in REQS)."""

    def __init__(self, sa, monkeypatch, tmp_path):
        super().__init__(sa, monkeypatch, tmp_path, mirror_gb=CAP_GB)
        self.req_to_token = torch.zeros((4, 8 * PAGE), dtype=torch.int64)
        self.idx = {rid: i for i, rid in enumerate(REQS)}
        for rid, (pages, tokens) in REQS.items():
            for k, p in enumerate(pages):
                self.req_to_token[self.idx[rid], k * PAGE] = p * PAGE  # c4 page k = req_to_token[k * page] // page
            self.land(rid, pages, tokens)

    def gate(self, rids: list[str], n_next: int = 1) -> set[str]:
        pool = SimpleNamespace(req_to_token=self.req_to_token)
        held = self.ad.queue_gate([(r, self.idx[r], REQS[r][1]) for r in rids], n_next, queue_gate.table_of(pool))
        self.engine.queued.drain()
        return held

    def mirror_exact(self, rid: str) -> None:
        """The mirror holds every landed byte of `rid` at its pool address (what the warm start reads)."""
        pages, tokens = REQS[rid]
        m = self.engine.mirror
        for j in range(tokens // 4):
            loc = pages[j // 64] * 64 + j % 64
            for l in range(2):
                row = self.lay.kv.read_chunks(m.kv[l], torch.tensor([loc // 64]), torch.tensor([loc % 64]))
                assert torch.equal(row[0], self.truth[loc][l]), (rid, j, l)


def _parked(q: Queue, faulty: FaultyFileOps | None = None) -> Queue:
    """a runs next, b and c wait: over the cap, b (written through `faulty` when given) then c are parked in the
    tier; their DRAM goes back."""
    before = resident_bytes(q.engine.mirror.kv)
    queued = q.engine.queued
    assert q.gate(["a", "b"]) == set()  # a's pages are in DRAM: nothing held
    assert queued.state("b") == PARKED and queued.state("a") != PARKED
    assert q.engine.tier.settle() and q.ad.stats()["disk_bytes_written"] > 0  # one-page cache: written behind
    if faulty is not None:
        faulty.plan.corrupt = 0
    assert q.gate(["a", "b", "c"]) == set() and queued.state("c") == PARKED
    assert q.engine.tier.settle()
    assert resident_bytes(q.engine.mirror.kv) < before
    assert queued.held_bytes() == len(REQS["a"][0]) * queued.page_bytes
    return q


def test_queued_pages_over_the_cap_wait_on_disk_and_come_back_exact(sa, monkeypatch, tmp_path):
    q = Queue(sa, monkeypatch, tmp_path)
    try:
        _parked(q)
        q.step(["a"])  # a runs
        assert q.gate(["b", "c"]) == {"b"}  # b runs next: held back while its pages are read back
        assert q.engine.queued.state("b") == READY and q.gate(["b", "c"]) == set()
        q.mirror_exact("b")
        assert q.ad.admission_refusals(["a", "b"], torch.tensor([PAGE, PAGE])) == []
        for _ in range(6):
            q.step(["a", "b"])  # b admitted: warm start from the restored bytes, every resident pick exact
        assert q.gate(["c"]) == {"c"} and q.gate(["c"]) == set()  # c next
        q.mirror_exact("c")
        for k in range(12):  # a finishes, c runs
            if k % 3 == 2:
                q.recall("c", k % 3)
            q.step(["b", "c"])
        st = q.ad.stats()
        assert st["disk_bytes_read"] > 0 and st["disk_decode_waits"] == 0, st
        assert st["disk_corrupt_pages"] == 0 and q.engine.queued.counters.restored_pages == 9
        assert q.check_held("b") >= 4 and check_invariants(q.engine) == []
    finally:
        q.ad.close()


@pytest.mark.parametrize("fault", ["read_error", "checksum"])
def test_a_bad_page_read_back_fails_only_its_request(sa, monkeypatch, tmp_path, fault):
    q = Queue(sa, monkeypatch, tmp_path)
    ops = FaultyFileOps()
    q.engine.tier.store.ops = ops
    if fault == "checksum":
        ops.plan.corrupt = 1000  # b's pages land damaged on disk (c's are written clean)
    try:
        _parked(q, ops)
        q.step(["a"])
        if fault == "read_error":
            ops.plan.read_errors = [errno.EIO] * 64  # every disk read fails while b is read back
        assert q.gate(["b", "c"]) == {"b"}
        ops.plan.read_errors = []
        why = q.engine.queued.refusal("b")
        assert why and "request b's page 0 could not be read back" in why, why
        assert ("corrupt" if fault == "checksum" else "read failed: Input/output error") in why, why
        assert q.gate(["b", "c"]) == set()  # let through: the precheck refuses it (sglang aborts it)
        refused = q.ad.admission_refusals(["a", "b"], torch.tensor([REQS["a"][1] + 1, REQS["b"][1] + 1]))
        assert [r for r, _ in refused] == ["b"]
        assert q.gate(["c"]) == {"c"} and q.gate(["c"]) == set()  # b left the queue; c comes back exact
        q.mirror_exact("c")
        for _ in range(6):
            q.step(["a", "c"])
        assert q.ad.stats()["disk_decode_waits"] == 0 and check_invariants(q.engine) == []
    finally:
        q.ad.close()


def test_the_patch_row_holds_a_parked_request_back_from_sglangs_admission(sa, monkeypatch, tmp_path):
    q = Queue(sa, monkeypatch, tmp_path)
    try:
        _parked(q)
        q.step(["a"])
        monkeypatch.setattr(RUNTIME, "engine", q.ad)
        reqs = [
            SimpleNamespace(rid=r, kv=SimpleNamespace(req_pool_idx=q.idx[r]), origin_input_ids=[0] * REQS[r][1])
            for r in "bc"
        ]  # sglang's Req: its req_to_token row on `kv`
        sched = SimpleNamespace(
            waiting_queue=list(reqs),
            req_to_token_pool=SimpleNamespace(size=4, req_to_token=q.req_to_token),
            max_running_requests=2,
        )
        running = SimpleNamespace(batch_size=lambda: 1)  # a: one slot free, b is next
        seen: list[list[str]] = []

        def original(self, running_batch):  # sglang's: takes the first free-slot's worth of the queue
            seen.append([r.rid for r in self.waiting_queue])
            self.waiting_queue = self.waiting_queue[1:]
            return "batch"

        assert queue_gate.around_prebuilt_batch(original, sched, running) == "batch"
        assert seen == [["c"]] and [r.rid for r in sched.waiting_queue] == ["b"]  # b held, then back in front
        q.engine.queued.drain()
        assert queue_gate.around_prebuilt_batch(original, sched, running) == "batch"
        assert seen[-1] == ["b"] and sched.waiting_queue == []  # b's pages are back: sglang admits it
    finally:
        q.ad.close()
