"""Faults in the disk tier with write-behind on the writer thread and read-ahead on the readers: a read error
fails only its request (a clear `CorruptPageError` naming it; the other request's pages publish exact bytes), and
a store file deleted under the running engine loses nothing (the open file keeps serving, every page comes back
exact, and close still succeeds)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from flashmemory.offload import OffloadEngine, check_invariants
from flashmemory.offload.disk import CorruptPageError, FaultyFileOps
from tests.offload.test_tiered_mirror import CFG, LAYOUT, admit_step, decode_step, recall, same_device_state, tiered


def test_a_read_error_fails_its_request_only(tmp_path) -> None:
    ops = FaultyFileOps()
    eng, plain = tiered(tmp_path, cache_pages=2, ops=ops), OffloadEngine(LAYOUT, CFG)
    g = torch.Generator().manual_seed(7)
    try:
        admit_step((eng, plain), [(0, "ra", 24), (1, "rb", 24)], g)
        decode_step((eng, plain), [0, 1], g)
        assert eng.tier.settle() and eng.tier_stats()["disk_bytes_written"] > 0
        eng.tier.drop_clean()
        recall((plain,), {1: [0, 1]})
        ops.plan.read_errors = [errno.EIO]  # the first disk read fails: request "ra"'s page 0
        with pytest.raises(CorruptPageError, match=r"page 0 of request 'ra'.*read failed") as err:
            recall((eng,), {0: [0], 1: [0, 1]})
        assert err.value.rid == "ra"
        pc = LAYOUT.page_chunks
        cells = eng.cells(torch.tensor([0, 1]), torch.arange(2 * pc).repeat(2, 1))
        want = plain.cells(torch.tensor([1]), torch.arange(2 * pc).unsqueeze(0))[0]
        assert (cells[0, :pc] < 0).all() and (cells[1] >= 0).all()
        for p in (0, 1):
            a, b = int(cells[1][p * pc]) // pc, int(want[p * pc]) // pc
            assert torch.equal(eng.reserve.kv[:, a], plain.reserve.kv[:, b]), f"page {p} of rb differs"
        assert not check_invariants(eng) and not eng.inflight
    finally:
        eng.close()


def test_a_deleted_store_loses_nothing(tmp_path) -> None:
    eng, plain = tiered(tmp_path, cache_pages=2), OffloadEngine(LAYOUT, CFG)
    g = torch.Generator().manual_seed(8)
    try:
        admit_step((eng, plain), [(0, "da", 28), (1, "db", 20)], g)
        decode_step((eng, plain), [0, 1], g)
        assert eng.tier.settle()
        os.unlink(eng.tier.store.path)  # an operator removes the store file under the running server
        for _ in range(6):  # more pages sealed and written behind after the deletion
            decode_step((eng, plain), [0, 1], g)
        assert eng.tier.settle()
        eng.tier.drop_clean()
        recall((eng, plain), {0: [0, 1, 2, 5], 1: [0, 1, 5]})
        same_device_state(plain, eng)
        st = eng.tier_stats()
        assert st["disk_bytes_read"] > 0 and st["disk_corrupt_pages"] == 0 and st["disk_write_errors"] == 0
    finally:
        eng.close()  # the file is already gone: close still succeeds
    assert not list(tmp_path.iterdir())
