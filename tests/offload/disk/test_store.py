"""PageStore: round trips, verification (corrupt / torn -> CorruptPageError naming request and page), space
accounting, O_DIRECT fallback, and the stale-file rule (a dead run's store goes, nothing else is touched)."""

from __future__ import annotations

import errno
import json
import os
import socket

import pytest
import torch

from flashmemory.offload.disk import (
    ALIGN,
    CorruptPageError,
    DiskTierError,
    FaultPlan,
    FaultyFileOps,
    PageStore,
    disk_page_bytes,
    fileops,
    pack_page,
    remove_stale_stores,
    unpack_page,
)
from flashmemory.offload.disk.store import MARKER
from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.mirror import HostMirror

PB = 5000  # a page payload that is not a multiple of ALIGN: the slot pads it


def page(i: int, n: int = PB) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(n))


def test_round_trip_and_space_returns(tmp_path) -> None:
    with PageStore(str(tmp_path), 4 * 8192, PB) as s:
        assert s.n_slots == 4 and s.slot_bytes == 8192 and s.slot_bytes % ALIGN == 0
        for i in range(3):
            s.write("r1", i, page(i))
        s.write("r2", 0, page(9))
        assert bytes(s.read("r1", 2)) == page(2) and bytes(s.read("r2", 0)) == page(9)
        with pytest.raises(OSError) as e:
            s.write("r2", 1, page(1))  # every slot in use: ENOSPC, nothing else lost
        assert e.value.errno == errno.ENOSPC
        with pytest.raises(OSError, match="all 4 page slots in use"):
            s.write("r1", 1, page(7))  # a rewrite needs a free slot too (copy on write) ...
        assert bytes(s.read("r1", 1)) == page(1)  # ... and the old copy stays readable
        assert s.free_request("r1") == 3 and s.free_slots == 3 and s.pages_of("r1") == set()
        s.write("r2", 1, page(1))
        s.write("r2", 1, page(5))  # rewrite: copy on write, the old slot comes back
        assert bytes(s.read("r2", 1)) == page(5) and s.used_slots == 2
        with pytest.raises(KeyError):
            s.read("r1", 0)
        path = s.path
        assert os.path.exists(path)
    assert not os.path.exists(path)  # close removes the store's own file


def test_corrupt_and_torn_pages_name_request_and_page(tmp_path) -> None:
    ops = FaultyFileOps()
    with PageStore(str(tmp_path), 8 * 8192, PB, ops=ops) as s:
        s.write("good", 0, page(0))
        s.write("bad", 3, page(3))
        with open(s.path, "r+b") as f:  # flip one payload byte on disk
            f.seek(s.slot_offset("bad", 3) + 200)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(CorruptPageError, match=r"page 3 of request 'bad' is corrupt on disk \(checksum") as e:
            s.read("bad", 3)
        assert (e.value.rid, e.value.page) == ("bad", 3)
        assert bytes(s.read("good", 0)) == page(0)  # another request is unaffected
        ops.plan.tear = 1
        s.write("torn", 1, page(1))  # reports success, only the first 4 KiB landed
        with pytest.raises(CorruptPageError, match="page 1 of request 'torn'"):
            s.read("torn", 1)
        ops.plan.corrupt = 1
        s.write("flip", 2, page(2))
        with pytest.raises(CorruptPageError, match="checksum mismatch"):
            s.read("flip", 2)
        ops.plan.read_errors = [errno.EIO]
        with pytest.raises(CorruptPageError, match="read failed"):
            s.read("good", 0)
        assert ops.injected == {"tear": 1, "corrupt": 1, "read_eio": 1}


def test_failed_rewrite_keeps_the_previous_copy(tmp_path) -> None:
    ops = FaultyFileOps(plan=FaultPlan(write_errors=[]))
    with PageStore(str(tmp_path), 4 * 8192, PB, ops=ops) as s:
        s.write("r", 0, page(0))
        ops.plan.write_errors = [errno.EIO]
        with pytest.raises(OSError):
            s.write("r", 0, page(1))
        assert bytes(s.read("r", 0)) == page(0) and s.used_slots == 1


def test_a_slot_of_another_page_is_not_accepted(tmp_path) -> None:
    """A slot reused by another page must not pass as the page the map names (the header's rid/page/sequence)."""
    with PageStore(str(tmp_path), 4 * 8192, PB) as s:
        s.write("a", 0, page(0))
        s.write("b", 5, page(5))
        with s._lock:  # point a's map entry at b's slot, as a bookkeeping bug would
            s._map[("a", 0)] = (s._map[("b", 5)][0], s._map[("a", 0)][1])
        with pytest.raises(CorruptPageError, match="slot holds another page"):
            s.read("a", 0)


def test_bad_directory_and_size_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(DiskTierError, match="SGLANG_PATHP_DISK_DIR=.*not an existing directory"):
        PageStore(str(tmp_path / "missing"), 1 << 20, PB)
    with pytest.raises(DiskTierError, match="raise SGLANG_PATHP_DISK_GB"):
        PageStore(str(tmp_path), 100, PB)
    assert os.listdir(tmp_path) == []


def test_o_direct_refused_falls_back_with_a_reason(tmp_path, monkeypatch, caplog) -> None:
    real = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, mode)

    monkeypatch.setattr(fileops.os, "open", no_direct)
    with caplog.at_level("WARNING", logger="flashmemory.offload.disk"):
        with PageStore(str(tmp_path), 4 * 8192, PB) as s:
            assert not s.direct and "refuses O_DIRECT" in s.fallback_reason
            s.write("r", 0, page(0))
            assert bytes(s.read("r", 0)) == page(0)
    assert "refuses O_DIRECT" in caplog.text


def _dead_run_store(d: str) -> str:
    """A store left behind by a process that died without closing it (forked child, os._exit)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            s = PageStore(d, 4 * 8192, PB)
            s.write("x", 0, page(0))
            os.write(w, s.path.encode())
        finally:
            os._exit(0)
    os.close(w)
    path = os.read(r, 4096).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return path


def test_stale_store_of_a_dead_run_is_removed_foreign_files_never(tmp_path) -> None:
    d = str(tmp_path)
    stale = _dead_run_store(d)
    assert os.path.exists(stale)
    host = socket.gethostname()
    foreign = {
        "notes.txt": b"user data",
        "fm-pagestore-r0-1-0123456789abcdef.fmps": b"no marker here",  # our name, not ours
        "fm-pagestore-r0-999999-bbbbbbbbbbbbbbbb.fmps": MARKER
        + json.dumps(  # another host's
            {"pid": 999999, "host": host + "-other", "token": "bbbbbbbbbbbbbbbb"}
        ).encode()
        + b"\n",
        "fm-pagestore-r0-999998-cccccccccccccccc.fmps.bak": b"x",  # not our name
    }
    for name, body in foreign.items():
        (tmp_path / name).write_bytes(body)
    live = PageStore(d, 4 * 8192, PB)  # a live store of this process: pid alive, lock held
    live.write("y", 0, page(1))
    assert live.stale_removed == [stale] and not os.path.exists(stale)
    with PageStore(d, 4 * 8192, PB) as other:  # a second store in the same dir leaves the live one alone
        assert other.stale_removed == [] and other.path != live.path
    assert bytes(live.read("y", 0)) == page(1)
    for name, body in foreign.items():
        assert (tmp_path / name).read_bytes() == body
    assert remove_stale_stores(d) == []
    live.close()


def test_pack_unpack_mirror_page() -> None:
    lay = OffloadLayout.tiny()
    m = HostMirror(lay, 4, pin=False)
    g = torch.Generator().manual_seed(0)
    m.kv.copy_(torch.randint(0, 256, m.kv.shape, dtype=torch.uint8, generator=g))
    m.index.copy_(torch.randint(0, 256, m.index.shape, dtype=torch.uint8, generator=g))
    blob = pack_page(m, 2)
    assert len(blob) == disk_page_bytes(lay)
    m2 = HostMirror(lay, 4, pin=False)
    unpack_page(blob, m2, 1)
    assert torch.equal(m2.kv[:, 1], m.kv[:, 2]) and torch.equal(m2.index[:, 1], m.index[:, 2])
    assert disk_page_bytes(OffloadLayout()) == 21 * 37440 + 18 * 8448
    with pytest.raises(ValueError, match="disk page"):
        unpack_page(blob[:-1], m2, 0)


def test_a_store_that_cannot_start_leaves_no_file(tmp_path) -> None:
    ops = FaultyFileOps(plan=FaultPlan(full=True))  # the marker block itself cannot be written
    with pytest.raises(
        DiskTierError,
        match=r"SGLANG_PATHP_DISK_DIR: cannot create the page store .*fmps.*disk full.*"
        r"SGLANG_PATHP_DISK_GB",
    ):
        PageStore(str(tmp_path), 4 * 8192, PB, ops=ops)
    assert os.listdir(tmp_path) == []
