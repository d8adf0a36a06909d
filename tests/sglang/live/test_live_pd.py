"""Live PD on CPU: `flashmemory serve` (what `make serve` runs: the
launch scripts under DEVICE=cpu, real sglang processes on 127.0.0.1) started twice side by side, once with
FlashMemory (D in shrink mode, KV moved by NIXL over host DRAM) and once with sglang's own HiSparse
(`--hisparse`: stock D with `--enable-hisparse` and a hot buffer smaller than the history, KV moved by
Mooncake's non-CUDA TCP build, the only backend HiSparse's DSv4 PD path accepts: decode.py:1809).

The reference tokens come from the folder's plain stock server (`stock_server`: no PD, no FlashMemory, the same
seed-0 weights), started beside the stacks; the folder's other shared servers start only after this module
(these two stacks beside them ran the box out of memory). The last test stops the FlashMemory stack with SIGINT
as Ctrl-C would.
- P really sent bytes (its `sglang:kv_transfer_total_mb` histogram) and D's greedy tokens equal stock sglang's
  (shrink mode lands P's c4 KV in the host mirror: wrong or missing bytes change them);
- HiSparse is exact by design: its D's tokens equal stock's for a prompt whose c4 history (2,200 / 4 entries)
  exceeds the hot buffer, and its torch swap-in really swapped (misses > 0, bytes = misses x 584);
- a chat completion through the router with the `openai` client returns content; churn and bad requests;
- Ctrl-C stops P, D and the router, and no process of their groups is left.
Every server is in its own process group; each fixture kills its groups on success and on failure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
pytest.importorskip("sglang")
pytest.importorskip("nixl._api", reason="PD on CPU moves KV with NIXL: pip install -e '.[serve-nixl]'")
pytest.importorskip(
    "mooncake.engine",
    reason="HiSparse PD on CPU moves KV with Mooncake (TCP): "
    "pip install -e '.[serve-mooncake-cpu]' and the OS package libibverbs1",
)

from flashmemory.serve.client import generate, parse_metrics  # noqa: E402
from flashmemory.serve.procs import _pgid_members, http_get  # noqa: E402
from flashmemory.serve.stack import HISPARSE_HOT  # noqa: E402
from tests.sglang.live.conftest import STARTUP_S, side_by_side  # noqa: E402
from tests.sglang.live.serve_cli import ServeCli  # noqa: E402

# 200 tokens: past a c128 block (c4 and c128 entries both cross PD) and inside one c4 page (64 chunks). A request
# enters D with only its newest page resident; the rest comes with its first Level-1 cycle, which runs after the
# first decode forward. Inside one page the whole history is resident from D's first step, so the tokens must match.
PROMPT = [40 + (7 * i) % 900 for i in range(200)]
NEW_TOKENS = 8


def _transferred_mb(prefill_url: str) -> float:
    status, body = http_get(prefill_url + "/metrics", timeout=10)
    assert status == 200, f"{prefill_url}/metrics answered {status}"
    return parse_metrics(body.decode(errors="replace"), prefix="sglang:kv_transfer_total_mb").get(
        "sglang:kv_transfer_total_mb_sum", 0.0
    )


@pytest.fixture(scope="module")
def stacks(serving_model, tiny_retriever_ckpt, tmp_path_factory, request):
    """A FlashMemory stack and a HiSparse one (`--hisparse`), started at the same moment as a user comparing them
    would: every port of both is picked while the other's servers are starting and binding theirs (a second
    stack's router once died with "Address already in use"). The folder's stock server starts beside them."""
    model = str(serving_model)  # the stock server's weights; Level 1 with the folder's retriever (no training here)
    fm = ServeCli(tmp_path_factory.mktemp("serve_logs"), "--model", model, "--ckpt", tiny_retriever_ckpt)
    hisparse = ServeCli(tmp_path_factory.mktemp("hisparse_serve_logs"), "--model", model, "--hisparse")
    try:
        request.getfixturevalue("stock_server")  # launched now, beside the stacks; waited for at first use
        for name, cli in (("flashmemory", fm), ("hisparse", hisparse)):
            cli.wait_ready()
            assert cli.ready is not None, f"{name} serve never printed READY:\n" + "\n".join(cli.lines[-60:])
            print(f"\n{name} serve: ready after {cli.ready_s:.0f} s, servers {cli.ready['startup_s']}")
        yield {"flashmemory": fm, "hisparse": hisparse}
    finally:
        for cli in (fm, hisparse):
            cli.kill_all()  # after the Ctrl-C test this finds nothing; on failure it cleans up
        groups, deadline = fm.pgids() | hisparse.pgids(), time.monotonic() + 60
        while _pgid_members(groups) and time.monotonic() < deadline:
            time.sleep(0.5)  # SIGKILLed members of a loaded box's groups take a moment to go
        assert _pgid_members(groups) == []


@pytest.fixture(scope="module")
def serve(stacks):
    return stacks["flashmemory"]


@pytest.fixture(scope="module")
def stock(stacks, stock_server):
    return stock_server.wait_ready(STARTUP_S)


@pytest.fixture(scope="module")
def stock_tokens(stock) -> list[int]:
    """Stock sglang's greedy tokens for PROMPT: one plain server, no PD, no FlashMemory."""
    return generate(stock.url, PROMPT, NEW_TOKENS)


def test_two_stacks_side_by_side_both_serve(stacks):
    """FlashMemory and HiSparse stacks on one host, started together, each answer through their own router."""
    urls = [c.ready["router"] for c in stacks.values()]
    assert len(set(urls)) == 2
    for cli in stacks.values():
        assert len(generate(cli.ready["router"], PROMPT, NEW_TOKENS)) == NEW_TOKENS


HISPARSE_PROMPT_LEN = 2200  # 550 c4 entries > HISPARSE_HOT: every decode step runs the swap-in, not the fast path


def _swapin(decode_url: str) -> dict[str, float]:
    status, body = http_get(decode_url + "/metrics", timeout=10)
    assert status == 200, f"{decode_url}/metrics answered {status}"
    m = parse_metrics(body.decode(errors="replace"), prefix="flashmemory_hisparse_swapin_")
    return {
        k.removeprefix("flashmemory_hisparse_swapin_").removesuffix("_total"): v
        for k, v in m.items()
        if k.endswith("_total")
    }


def _preload(pid: int) -> str:
    """LD_PRELOAD in the environment process `pid` started with ("" if unset or unreadable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    return next((v[11:].decode(errors="replace") for v in env if v.startswith(b"LD_PRELOAD=")), "")


MOONCAKE_RPC_PORTS = range(15000, 17001)  # Mooncake's RPC/handshake port range (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)


def test_stack_servers_listen_on_loopback_by_default(stacks):
    """Every listening socket of every process of each stack (routers, P and D launchers, their schedulers and
    detokenizers: all members of the stack's process groups) is bound on loopback only (127.0.0.0/8, an IPv4-mapped
    127.0.0.1, or ::1), read from /proc: the HTTP ports that follow HOST and sglang's internal listeners
    (torch.distributed rendezvous, gloo, NIXL's side channel and UCX), which the launch scripts keep on 127.0.0.1
    by default, and the HiSparse stack's Mooncake transfer engines, whose every-interface binds the preloaded
    loopback-bind shim moves (the HiSparse test below moves KV through them). Only on a machine without a C
    compiler, where the shim cannot be built, may Mooncake's RPC and data ports (two for each of P and D, in its
    RPC range) stay wide, as docs/serving.md says."""
    from urllib.parse import urlparse

    from flashmemory.serve.loopback import compiler
    from tests.docs.listening import is_loopback, listening

    for name, cli in stacks.items():
        members = set(_pgid_members(cli.pgids()))
        ports = listening(members)
        for url in (cli.ready["router"], cli.ready["prefill"], cli.ready["decode"]):
            assert urlparse(url).port in ports, (name, url, sorted(ports))
        wide = {port: addrs for port, addrs in ports.items() if not all(is_loopback(a) for a in addrs)}
        if name == "hisparse":
            if compiler() is not None:  # P's and D's servers run with the shim preloaded
                assert sum("loopback_bind-" in _preload(pid) for pid in members) >= 2, f"{name}: shim not preloaded"
            else:
                assert len(wide) <= 4 and all(p in MOONCAKE_RPC_PORTS for p in wide), f"{name}: {wide} ({ports})"
                continue
        assert wide == {}, f"{name}: listeners beyond loopback {wide} (all: {ports})"


def test_hisparse_decodes_stock_tokens_with_counted_swapins(stacks, stock):
    assert HISPARSE_PROMPT_LEN // 4 > HISPARSE_HOT
    rng = random.Random(19)
    ids = [rng.randrange(26, 1024) for _ in range(HISPARSE_PROMPT_LEN)]
    r = stacks["hisparse"].ready
    want, got = side_by_side(
        lambda: generate(stock.url, ids, NEW_TOKENS), lambda: generate(r["router"], ids, NEW_TOKENS)
    )
    counts = _swapin(r["decode"])
    # Exact, not tie-tolerant: P's prefill is stock's (same kernels, same batch of one), the KV moves byte for byte,
    # and HiSparse's D gathers the same picked KV values in the same order from its hot buffer into the same
    # sparse decode kernel: the same bits as stock, so every top-k and greedy pick resolves alike.
    assert got == want, f"HiSparse D {got} != stock {want} (counters {counts})"
    assert counts.get("misses", 0) > 0 and counts.get("calls", 0) > 0, counts
    assert counts["bytes_h2d"] == counts["misses"] * 584, counts
    assert counts["hits"] > 0, counts  # later steps find most of the picks in the hot buffer
    d_log = (stacks["hisparse"].log_dir / "decode.log").read_text(errors="replace")
    assert "'enable_hisparse': True" in d_log and "FlashMemory Path-P" not in d_log


def test_flashmemory_pd_moves_bytes_and_equals_stock(serve, stock_tokens):
    r = serve.ready
    t = time.monotonic()
    tokens = generate(r["router"], PROMPT, NEW_TOKENS)
    mb = _transferred_mb(r["prefill"])
    print(f"\nPD FlashMemory request: {time.monotonic() - t:.1f} s; P sent {mb:.3f} MB; tokens {tokens}")
    assert mb > 0, "P reported no KV bytes sent"
    # Exact, not tie-tolerant: P's prefill is stock's, its KV lands in D's host mirror byte for byte, and this
    # 200-token history is all resident, so D's sparse decode reads the same values in the same pick order: same bits.
    assert tokens == stock_tokens
    d_log = (serve.log_dir / "decode.log").read_text(errors="replace")
    assert "FlashMemory Path-P (shrink mode)" in d_log and "registered with NIXL as host DRAM" in d_log


def test_openai_chat_through_router(serve):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=serve.ready["router"] + "/v1", api_key="none", timeout=600)
    t = time.monotonic()
    resp = client.chat.completions.create(
        model="default", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Say hello."}]
    )
    print(f"\nopenai chat through the router: {time.monotonic() - t:.1f} s: {resp.choices[0].message.content!r}")
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens > 0


def _post_status(url: str, body: bytes) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


BAD_REQUESTS = {  # what a buggy or hostile client sends; each must be a 4xx, never a crash or a hang
    "broken json": b'{"model": "default", "messages": [',
    "no messages": json.dumps({"model": "default", "max_tokens": 4}).encode(),
    "unknown role": json.dumps(
        {"model": "default", "max_tokens": 4, "messages": [{"role": "wizard", "content": "hi"}]}
    ).encode(),
    "negative max_tokens": json.dumps(
        {"model": "default", "max_tokens": -5, "messages": [{"role": "user", "content": "hi"}]}
    ).encode(),
    "negative temperature": json.dumps(
        {"model": "default", "max_tokens": 4, "temperature": -1, "messages": [{"role": "user", "content": "hi"}]}
    ).encode(),
    "prompt past the context": json.dumps(
        {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 6000}]}
    ).encode(),
}


def test_grafana_dashboard_charts_what_the_decode_servers_export(stacks):
    """Every flashmemory_* series docs/grafana/flashmemory.json charts is on a live decode server's /metrics: the
    FlashMemory D's, or the HiSparse D's for its swap-in counters (the HiSparse test above decoded there). Not
    on these servers, by design: the guard's labelled failure counter (no series until a request fails), and the
    miss monitor's and disk tier's gauges (a multiprocess gauge has no series until set, and both features are off
    here), and the HiSparse prefetch mode's counters (that mode is off on these stacks; its live test reads them);
    their names are checked against the exporter in tests/docs/test_grafana.py."""
    import json

    from flashmemory.sglang.metrics.prometheus import (
        DISK_KEYS,
        HISPARSE_PREFETCH,
        HISPARSE_PREFETCH_PREFIX,
        METRICS,
        MONITOR_KEYS,
        PREFIX,
    )
    from tests.docs.test_grafana import DASHBOARD, charted

    feature_gauges = {PREFIX + k for k in (*MONITOR_KEYS, *DISK_KEYS) if METRICS[k][0] == "gauge"}
    feature_gauges |= {f"{PREFIX}{HISPARSE_PREFETCH_PREFIX}{k}_total" for k in HISPARSE_PREFETCH}
    exported: set[str] = set()
    for cli in stacks.values():
        status, body = http_get(cli.ready["decode"] + "/metrics", timeout=60)
        assert status == 200, cli.ready["decode"]
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("flashmemory_"):
                exported.add(line.split("{")[0].split(" ")[0])
    missing = (
        charted(json.loads(DASHBOARD.read_text())) - exported - {PREFIX + "request_failures_total"} - feature_gauges
    )
    assert not missing, sorted(missing)


def test_churn_with_dropped_streams_and_bad_requests(serve):
    """A concurrent burst through the router with the `openai` client (four chats of ~60 to ~1,000 tokens, two streams
    dropped after two chunks) and six malformed requests: every good one answered, every bad one a 4xx, and the
    same greedy answer before and after; the servers still serve, and D's gauges read idle afterwards: no live
    request, every reserve block free, no host-mirror bytes in use."""
    openai = pytest.importorskip("openai")
    router = serve.ready["router"]
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", timeout=900, max_retries=0)

    def chat(words: int, max_tokens: int = 12) -> str:
        text = " ".join(f"note {i} says the value is {i * 7 % 97}." for i in range(words // 6 + 1))
        r = client.chat.completions.create(
            model="default", max_tokens=max_tokens, temperature=0, messages=[{"role": "user", "content": text}]
        )
        assert r.usage.completion_tokens > 0
        return r.choices[0].message.content

    def dropped_stream(words: int) -> int:
        stream = client.chat.completions.create(
            model="default",
            max_tokens=64,
            temperature=0,
            stream=True,
            messages=[{"role": "user", "content": "tell me " * words}],
        )
        got = 0
        for _ in stream:
            got += 1
            if got == 2:
                break
        stream.close()
        return got

    before = chat(30)
    results: dict[str, object] = {}

    def run(name, fn, *a):
        try:
            results[name] = fn(*a)
        except Exception as e:  # noqa: BLE001 - reported below with its name
            results[name] = e

    # ~60 to ~1,000 tokens each: P prefills them one after another on the same 2 cores as D, and a burst of
    # 2-3K-token chats kept P too busy to answer D's bootstrap heartbeats under a loaded suite
    jobs = [(f"chat{w}", chat, w) for w in (10, 40, 90, 160)]
    jobs += [(f"stream{w}", dropped_stream, w) for w in (40, 120)]
    jobs += [(f"bad: {k}", _post_status, router + "/v1/chat/completions", v) for k, v in BAD_REQUESTS.items()]
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1200)
    failed = {k: v for k, v in results.items() if isinstance(v, Exception)}
    assert not failed, failed
    assert len(results) == len(jobs)
    for k in BAD_REQUESTS:
        assert 400 <= results[f"bad: {k}"] < 500, (k, results[f"bad: {k}"])
    assert all(results[f"stream{w}"] == 2 for w in (40, 120))
    assert chat(30) == before
    assert http_get(serve.ready["decode"] + "/health", timeout=30)[0] == 200
    # Gauges tell the truth: with nothing running D's /metrics reads idle, dropped streams included
    # (the scheduler's idle hook releases the rows of requests that finished after the last decode forward).
    deadline, gauges = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        gauges = parse_metrics(http_get(serve.ready["decode"] + "/metrics", timeout=30)[1].decode(errors="replace"))
        if gauges.get("flashmemory_live_requests") == 0:
            break
        time.sleep(1.0)
    print("\nD at idle: " + ", ".join(f"{k} {v:g}" for k, v in sorted(gauges.items()) if "{" not in k))
    assert gauges.get("flashmemory_live_requests") == 0, gauges
    assert gauges.get("flashmemory_reserve_blocks", 0) > 0, gauges
    assert gauges.get("flashmemory_free_reserve_blocks") == gauges["flashmemory_reserve_blocks"], gauges
    assert gauges.get("flashmemory_host_mirror_bytes_in_use") == 0, gauges
    assert gauges.get("flashmemory_reserve_used_fraction") == 0 and gauges.get("flashmemory_resident_fraction") == 0


def test_ctrl_c_stops_all_three(serve):
    """Last in this module: SIGINT to `flashmemory serve` (as Ctrl-C in its terminal) stops P, D and the router."""
    assert len(serve.ready["pgids"]) == 3 and _pgid_members(set(serve.ready["pgids"]))
    os.kill(serve.p.pid, signal.SIGINT)
    rc = serve.p.wait(timeout=120)
    rest = serve.rest()
    assert rc == 0, rest
    assert "stopped: all servers gone" in rest
    assert _pgid_members(serve.pgids()) == []
