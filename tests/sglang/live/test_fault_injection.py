"""A failure costs one request, never the server, on the folder's small-budget server
(`live_servers["small"]`: Path-P at a small budget), which runs with the test-only fault injector
(FLASHMEMORY_FAULT_INJECT="hook=before_forward,rid=^faulty-": only requests named faulty-* are faulted).

Three requests at once: two good ones in one batched /generate call, and a faulted one sent while they decode. The
faulted one fails in its first forward (its prefill) and is aborted there: its client gets an HTTP 500 naming the
hook, and it never joins the good ones' decode batches. Their greedy tokens equal a fault-free run of the same
batched call (stock sglang on CPU is not batch-invariant, so both runs decode the same pair and nothing else).
Then the next request is served, the failure is counted once on /metrics, and the gauges say idle."""

import re
import threading
import time

import pytest

from tests.sglang.live.conftest import prompt

GOOD = [(600, 21), (300, 22)]  # (prompt tokens, seed)
STEPS = 24


def _metric(text: str, name: str, labels: str = "") -> float | None:
    """The sample `name` whose label set contains every `labels` pair (e.g. 'hook="before_forward"'); series
    also carry dp_rank/attn_tp_rank labels, so the match is by subset, summed over what matches; None when absent."""
    want = set(re.findall(r'\w+="[^"]*"', labels))
    hits = [
        float(m.group(2))
        for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M)
        if want <= set(re.findall(r'\w+="[^"]*"', m.group(1) or ""))
    ]
    return sum(hits) if hits else None


def _good(server, tag: str) -> list[list[int]]:
    body = {
        "input_ids": [prompt(n, seed) for n, seed in GOOD],
        "rid": [f"{tag}-{i}" for i in range(len(GOOD))],
        "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True},
    }
    return [r["output_ids"] for r in server.post("/generate", body, 1800)]


@pytest.fixture(scope="module")
def faulty(live_servers):
    return live_servers["small"]


def test_a_faulted_request_fails_alone(faulty):
    reference = _good(faulty, "ref")
    got: dict[str, object] = {}

    def run(name, fn):
        try:
            got[name] = fn()
        except Exception as e:  # noqa: BLE001 - asserted below
            got[name] = e

    body = {
        "input_ids": prompt(200, 23),
        "rid": "faulty-1",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    }
    good = threading.Thread(target=run, args=("good", lambda: _good(faulty, "good")))
    bad = threading.Thread(target=run, args=("faulty", lambda: faulty.post("/generate", body, 600)))
    good.start()
    time.sleep(1.0)  # the good pair is prefilling or decoding when the faulted one arrives
    bad.start()
    for t in (good, bad):
        t.join(1800)
    assert isinstance(got["faulty"], Exception), f"the faulted request was served: {got['faulty']}"
    assert "HTTP 500" in str(got["faulty"]) and "before_forward" in str(got["faulty"]), got["faulty"]
    # Exact, not tie-tolerant: the same server decodes the same good pair in one batch both times (the faulted
    # request never joins it), so both runs compute the same bits.
    assert got["good"] == reference, f"fault-free {reference}; beside the fault {got['good']}"
    # the server keeps serving
    assert len(faulty.generate(prompt(150, 24), 4)["output_ids"]) == 4
    log = faulty.log.read_text(errors="replace")
    assert "FlashMemory: request faulty-1 failed in before_forward" in log
    assert "engine state in doubt" not in log
    # the gauges say idle once nothing runs (the scheduler's idle hook publishes them)
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        text = faulty.get_text("/metrics")
        if _metric(text, "flashmemory_live_requests") == 0:
            break
        time.sleep(1.0)
    print("\n".join(ln for ln in text.splitlines() if ln.startswith("flashmemory_")))
    assert _metric(text, "flashmemory_request_failures_total", '{hook="before_forward"}') == 1.0  # only faulty-1
    assert _metric(text, "flashmemory_live_requests") == 0
    total = _metric(text, "flashmemory_reserve_blocks")
    assert total and _metric(text, "flashmemory_free_reserve_blocks") == total
    assert _metric(text, "flashmemory_host_mirror_bytes_in_use") == 0
    assert (
        _metric(text, "flashmemory_reserve_used_fraction") == 0 and _metric(text, "flashmemory_resident_fraction") == 0
    )
