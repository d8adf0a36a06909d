"""The disk tier live: the small-budget server (c) plus SGLANG_PATHP_DISK_DIR (its own server),
with a host page cache of 1 page, far smaller than the requests' sealed pages, so pages are written behind to the
page store and Level 1's recalls read them back from disk (verified). Its greedy tokens equal the host-only
small-budget server's (`live_servers["small"]`) on the same requests, /metrics counts disk bytes both ways, the
startup log states the tier's size and place, and the store file is there while the server runs. The host mirror
runs as a landing window (SGLANG_PATHP_HOST_MIRROR_GB): a few DRAM page slots instead of one per page id.

Both servers run Level 1 synchronously (conftest.SMALL_BUDGET): at a small budget the tokens depend on the step a
recall is published at, and an asynchronous recall that waits on disk lands later than one served from DRAM
(with async Level 1 a first run differed from the 7th token of the 3,000-token request, right after two recalls
waited on disk). Cycles are counted per request, so the two servers' other requests do not shift the phase."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from tests.sglang.live.conftest import SMALL_ARGS, STARTUP_S, disk_tier_env, make_server, prompt, side_by_side

REQS = [(2400, 21, 20), (3000, 22, 20)]  # (prompt tokens, seed, new tokens): 9-12 pages of 64 c4 chunks each


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def disk_server(serving_model, live_logs, tiny_retriever_ckpt, tmp_path_factory):
    """(c) + the disk tier, for this module only. Launched without waiting: `runs` asks for the folder's shared
    servers after it, so all of them start at once (startup is mostly imports), and waits for it there."""
    disk = tmp_path_factory.mktemp("disk_tier")
    srv = make_server(
        serving_model,
        live_logs,
        "disk_tier",
        extra_args=SMALL_ARGS,
        env={**disk_tier_env(disk), "SGLANG_RETRIEVER_INLINE_CKPT": tiny_retriever_ckpt},
    )
    try:
        yield srv, disk
    finally:
        srv.stop()
    assert srv.leftovers() == []


@pytest.fixture(scope="module")
def runs(disk_server, live_servers):
    """The same requests, one after another, on the disk-tier server and on the host-only small-budget server;
    the two servers run side by side (Level 1 is synchronous on both, so timing does not change their tokens)."""
    srv, disk = disk_server
    srv.wait_ready(STARTUP_S)

    def requests(s) -> list[list[int]]:
        return [s.generate(prompt(n, seed), steps)["output_ids"] for n, seed, steps in REQS]

    on_disk, on_host = side_by_side(lambda: requests(srv), lambda: requests(live_servers["small"]))
    # /metrics is published at the scheduler's next step or idle poll: read it once the last request's row is gone
    deadline, text = time.monotonic() + 120, srv.get_text("/metrics")
    while _metric(text, "flashmemory_live_requests") != 0 and time.monotonic() < deadline:
        time.sleep(1.0)
        text = srv.get_text("/metrics")
    return {"disk": on_disk, "host": on_host}, text, srv, disk


def test_disk_tier_tokens_equal_the_host_only_server(runs):
    outs, *_ = runs
    assert [len(o) for o in outs["disk"]] == [r[2] for r in REQS]
    # Exact, not tie-tolerant: both servers run the same configuration, synchronous Level 1 and one request at a
    # time; the disk tier hands back checksummed identical page bytes, so both compute the same bits.
    assert outs["disk"] == outs["host"], "the disk tier changed the greedy tokens"


def test_disk_tier_counters_and_startup_line(runs):
    _, text, srv, disk = runs
    print("\n".join(l for l in text.splitlines() if l.startswith("flashmemory_disk")))
    assert _metric(text, "flashmemory_disk_bytes_written_total") > 0, "nothing was written behind"
    assert _metric(text, "flashmemory_disk_bytes_read_total") > 0, "no recall read a page back from disk"
    assert _metric(text, "flashmemory_disk_cache_misses_total") > 0
    assert _metric(text, "flashmemory_disk_write_errors_total") == 0
    assert _metric(text, "flashmemory_disk_corrupt_pages_total") == 0
    assert _metric(text, "flashmemory_live_requests") == 0
    log = srv.log.read_text(errors="replace")
    assert re.search(rf"disk tier \(rank 0\): \d+ pages of \d+ B on disk at {re.escape(str(disk))}", log), (
        "the startup log does not state the tier's size and place"
    )
    stores = list(disk.glob("fm-pagestore-r0-*.fmps"))
    assert len(stores) == 1, stores
    # The host mirror is a landing window: far fewer DRAM page slots than page ids, so host DRAM is lower
    window = re.search(r"host mirror landing window (\d+) of (\d+) page slots", log)
    assert window, "the startup log does not state the host mirror's landing window"
    slots, pages = int(window.group(1)), int(window.group(2))
    assert slots < pages // 4, (slots, pages)
    page_bytes = int(re.search(r"\d+ pages of (\d+) B on disk", log).group(1))
    assert 0 < _metric(text, "flashmemory_host_mirror_bytes") <= slots * page_bytes  # a disk page holds a mirror page


def _rot(store: Path, block: int = 4096) -> int:
    """Bit rot on the page store: one byte flipped in every 4 KB block past the marker block, so every slot written
    so far fails verification (a slot's first block is all header and payload). Returns the blocks flipped."""
    n = 0
    with open(store, "r+b") as f:
        size = f.seek(0, 2)
        for off in range(block + block // 2, size, block):
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
            n += 1
    return n


def test_a_corrupt_disk_page_fails_its_request_and_the_server_serves_on(runs):
    """Faults: the store file rots under a decoding request whose pages went to disk. The request's next
    recall of a rotten page fails verification: that request alone fails (HTTP 500, its page named in the log,
    counted), and the server serves the next request."""
    _, _, srv, disk = runs
    store = next(disk.glob("fm-pagestore-r0-*.fmps"))
    written0 = _metric(srv.get_text("/metrics"), "flashmemory_disk_bytes_written_total")
    got: dict[str, object] = {}

    def run():
        body = {
            "input_ids": prompt(2000, 31),
            "rid": "corrupt-1",
            "sampling_params": {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True},
        }
        try:
            got["r"] = srv.post("/generate", body, 1800)
        except Exception as e:  # noqa: BLE001 - asserted below
            got["r"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 900  # its pages are written behind from its second decode step on
    while t.is_alive() and time.monotonic() < deadline:
        if _metric(srv.get_text("/metrics"), "flashmemory_disk_bytes_written_total") > written0:
            break
        time.sleep(0.5)
    assert t.is_alive(), f"the request ended before any of its pages went to disk: {got}"
    assert _rot(store) > 0
    t.join(1800)
    assert isinstance(got["r"], Exception) and "HTTP 500" in str(got["r"]), f"the rotten request was served: {got}"
    assert len(srv.generate(prompt(150, 24), 4)["output_ids"]) == 4  # the server keeps serving
    log = srv.log.read_text(errors="replace")
    # Level 1 runs in the after_forward hook: the guard names that hook, the reason names the page
    assert re.search(
        r"FlashMemory: request corrupt-1 failed in \w+ \(disk tier: page \d+ of request 'corrupt-1' "
        r"is corrupt on disk",
        log,
    ), log[-3000:]
    assert "engine state in doubt" not in log
    deadline, corrupt = time.monotonic() + 60, 0.0  # /metrics is published at the scheduler's next step or idle
    while time.monotonic() < deadline:
        corrupt = _metric(srv.get_text("/metrics"), "flashmemory_disk_corrupt_pages_total")
        if corrupt >= 1:
            break
        time.sleep(1.0)
    assert corrupt >= 1, "the corrupt page was not counted"
