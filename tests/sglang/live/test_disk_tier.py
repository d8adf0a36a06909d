"""The disk tier live (issue 22): the small-budget server (c) plus SGLANG_PATHP_DISK_DIR, with a host page cache
of a few pages, far smaller than the requests' sealed pages, so pages are written behind to the page store and
Level 1's recalls read them back from disk (verified). Its greedy tokens equal the host-only small-budget
server's on the same requests, /metrics counts disk bytes both ways, the startup log states the tier's size and
place, and the store file's space returns when the requests finish."""

from __future__ import annotations

import re

import pytest

from tests.sglang.live.conftest import SMALL_ARGS, SMALL_BUDGET, make_server, prompt

REQS = [(2400, 21, 12), (3000, 22, 12)]   # (prompt tokens, seed, new tokens): 9-12 pages of 64 c4 chunks each
CACHE_GB = "0.0003"                        # 300 KB: a few tiny-model pages (2 c4 layers x 37,440 B each)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def disk_server(serving_model, live_logs, tiny_retriever_ckpt, tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk_tier")
    env = {**SMALL_BUDGET, "SGLANG_RETRIEVER_INLINE_CKPT": tiny_retriever_ckpt, "SGLANG_PATHP_DISK_DIR": str(disk),
           "SGLANG_PATHP_DISK_GB": "0.1", "SGLANG_PATHP_HOST_CACHE_GB": CACHE_GB}
    srv = make_server(serving_model, live_logs, "disk_tier", env=env, extra_args=SMALL_ARGS)
    try:
        srv.wait_ready(600)
        yield srv, disk
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def runs(disk_server, live_servers):
    srv, disk = disk_server
    outs = {name: [s.generate(prompt(n, seed), steps)["output_ids"] for n, seed, steps in REQS]
            for name, s in (("disk", srv), ("host", live_servers["small"]))}
    return outs, srv.get_text("/metrics"), srv, disk


def test_disk_tier_tokens_equal_the_host_only_server(runs):
    outs, *_ = runs
    assert [len(o) for o in outs["disk"]] == [r[2] for r in REQS]
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
    assert re.search(rf"disk tier \(rank 0\): \d+ pages of \d+ B on disk at {re.escape(str(disk))}", log), \
        "the startup log does not state the tier's size and place"
    stores = list(disk.glob("fm-pagestore-r0-*.fmps"))
    assert len(stores) == 1, stores
