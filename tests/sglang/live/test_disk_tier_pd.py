"""The disk tier live in PD shrink mode on CPU: P, D (FlashMemory, shrink mode, Level 1 with the folder's retriever,
KMAX 16 pages = a whole 4K history: full budget, one running request) and the router, with SGLANG_PATHP_DISK_DIR
on D, a host page cache of one page and SGLANG_PATHP_HOST_MIRROR_GB = two pages. P's c4 KV lands by NIXL in D's
sparse host mirror; from D's second step on every complete page is sealed into the tier (written behind to the
store: the cache holds one page) and its mirror DRAM goes back. Checked: D's greedy tokens equal the plain stock
server's for histories of 5-10 pages (far beyond the one-page cache), pages were written to disk, the decode
thread never waited on disk I/O, nothing is corrupt, and D's startup log states the tier's size and place.

D runs with the queued-requests cap on (SGLANG_PATHP_HOST_MIRROR_GB, read by the Patch row around the decode
scheduler's admission from its waiting queue) and one running request. A long request runs first; two more are
sent while it decodes, so both land and wait (a round in which P was too slow for that runs once more): the one
at the queue's tail is over the cap, its landed pages are parked in the tier and their DRAM goes back; before it
runs they are read back from disk (verified) and only then is it admitted, so its tokens still equal stock's and
the decode thread still never waits on disk. At full budget a running request's pages are all resident from
admission, so no recall reads one back; reads by recalls under a smaller budget run in-process
(test_shrink_disk_tier) and live in copy mode (test_disk_tier)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
pytest.importorskip("sglang")
pytest.importorskip("nixl._api", reason="PD on CPU moves KV with NIXL: pip install -e '.[serve-nixl]'")

from flashmemory.serve.client import generate, parse_metrics  # noqa: E402
from flashmemory.serve.procs import Servers, http_get  # noqa: E402
from flashmemory.serve.stack import PDConfig, start_pd  # noqa: E402
from tests.sglang.live.conftest import DISK_CACHE_GB, STARTUP_S, prompt  # noqa: E402

FIRST = (2400, 61, 800)  # (prompt tokens, seed, new tokens): decodes long enough for the next two to land and wait
QUEUED = [(1200, 62, 12), (1300, 63, 12)]  # 300-325 c4 entries, 5 pages of 64 each: over the two-page cap
ROUNDS = 2  # a round whose queued requests did not both land while the first decoded (P was slower) runs again
MIRROR_GB = "0.00015"  # 150 KB: two 74,880-B pages


@pytest.fixture(scope="module")
def stack(serving_model, tiny_retriever_ckpt, tmp_path_factory, request):
    disk = tmp_path_factory.mktemp("pd_disk_tier")
    knobs = {
        "MAX_RUN": "1",
        "CKPT": tiny_retriever_ckpt,
        "KMAX": "16",
        "SGLANG_PATHP_DISK_DIR": str(disk),
        "SGLANG_PATHP_DISK_GB": "0.1",
        "SGLANG_PATHP_HOST_CACHE_GB": DISK_CACHE_GB,
        "SGLANG_PATHP_HOST_MIRROR_GB": MIRROR_GB,
    }
    cfg = PDConfig(model=Path(serving_model), decode_env=knobs, prefill_env={"MAX_RUN": "2"}, startup_timeout=STARTUP_S)
    logs = tmp_path_factory.mktemp("pd_disk_tier_logs")
    servers = Servers(logs)
    request.getfixturevalue("stock_server")  # launched beside the stack; waited for at first use
    try:
        yield start_pd(servers, cfg), logs, disk
    finally:
        servers.stop()
        assert not servers.leftovers()


def _metrics(url: str) -> dict[str, float]:
    status, body = http_get(url + "/metrics", timeout=10)
    assert status == 200, f"{url}/metrics answered {status}"
    return parse_metrics(body.decode(errors="replace"), prefix="flashmemory_")


def _idle_metrics(url: str) -> dict[str, float]:
    """D's counters once it has no live request (they are published at the idle poll)."""
    deadline, m = time.monotonic() + 120, _metrics(url)
    while m.get("flashmemory_live_requests", 1) != 0 and time.monotonic() < deadline:
        time.sleep(1.0)
        m = _metrics(url)
    return m


def _running(url: str, timeout: float = 120.0) -> None:
    """Return once D has a live request (its admission has happened), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _metrics(url).get("flashmemory_live_requests", 0) < 1:
        time.sleep(0.2)


def test_pd_shrink_with_the_disk_tier_equals_stock(stack, stock_server):
    from concurrent.futures import ThreadPoolExecutor

    pd, logs, disk = stack
    stock = stock_server.wait_ready(STARTUP_S)
    d_log_path = logs / "decode.log"
    for r in range(ROUNDS):
        reqs = [(n, seed + 10 * r, k) for n, seed, k in [FIRST, *QUEUED]]
        with ThreadPoolExecutor(len(reqs) + 1) as ex:
            want = ex.submit(lambda reqs=reqs: [generate(stock.url, prompt(n, seed), k) for n, seed, k in reqs])
            first = ex.submit(generate, pd.router_url, prompt(reqs[0][0], reqs[0][1]), reqs[0][2])
            _running(pd.decode_url)
            queued = [ex.submit(generate, pd.router_url, prompt(n, seed), k) for n, seed, k in reqs[1:]]
            got = [first.result(), *(f.result() for f in queued)]
            want = want.result()
        for (n, _, _), g, w in zip(reqs, got, want):
            assert g == w, f"{n}-token request: D with the disk tier {g} != stock {w}"
        if "landed pages wait in the tier" in d_log_path.read_text(errors="replace"):
            break
    m = _idle_metrics(pd.decode_url)
    print("\n" + "\n".join(f"{k} {v}" for k, v in sorted(m.items()) if "disk" in k or "mirror" in k))
    assert m["flashmemory_disk_bytes_written_total"] > 0, "no sealed page went to disk"
    d_log = d_log_path.read_text(errors="replace")
    parked = re.findall(r"queued request \S+: (\d+) landed pages wait in the tier", d_log)
    back = re.findall(r"queued request \S+: (\d+) pages read back into host DRAM before it runs", d_log)
    assert parked and back, f"no queued request was parked and read back (parked {parked}, read back {back})"
    assert m["flashmemory_disk_bytes_read_total"] > 0, "parked pages were not read back from disk"
    assert m["flashmemory_disk_decode_waits_total"] == 0, "the decode thread waited on disk I/O"
    assert m["flashmemory_disk_corrupt_pages_total"] == 0 and m["flashmemory_disk_write_errors_total"] == 0
    assert "FlashMemory Path-P (shrink mode)" in d_log or "FlashMemory Path-P shrink" in d_log
    assert "caps the landed pages of requests waiting to run" in d_log
    assert re.search(rf"disk tier \(rank 0\): \d+ pages of \d+ B on disk at {re.escape(str(disk))}", d_log)
