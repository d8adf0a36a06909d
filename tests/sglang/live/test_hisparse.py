"""sglang's own HiSparse live on CPU (issue 19, item 2): D with --enable-hisparse and a hot buffer smaller than
the history, behind P and the router, KV moved by Mooncake's non-CUDA TCP build (HiSparse's DSv4 PD path is
written for Mooncake: decode.py:1809 refuses every other backend).

One stack: D = the project's `launch_decode.sh` command (DRY_RUN prints it) plus the HiSparse flags, P and the
router from their launch scripts. The reference is the folder's plain stock server (`live_servers["stock"]`: no
PD, no FlashMemory, the same seed-0 weights); one server fewer to start keeps the suite in its time budget.
HiSparse is exact by design, so:
- D's greedy tokens equal stock's for a prompt whose c4 history (PROMPT_LEN / 4 entries) exceeds the hot buffer;
- the torch swap-in really swapped: D's /metrics counts misses > 0 and bytes = misses x 584.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
pytest.importorskip("sglang")
pytest.importorskip("mooncake.engine", reason="HiSparse PD on CPU moves KV with Mooncake (TCP): "
                                              "pip install -e '.[serve-mooncake-cpu]' and the OS package libibverbs1")

from flashmemory.serve.client import generate, parse_metrics  # noqa: E402
from flashmemory.serve.procs import Servers, free_ports, http_get  # noqa: E402
from flashmemory.serve.stack import REPO, router_ready  # noqa: E402

HOT = 512                       # hot-buffer slots per c4 layer per request (>= the model's index_topk, 512)
PROMPT_LEN = 2200               # 550 c4 entries > HOT: every decode step runs the swap-in, not the fast path
NEW_TOKENS = 8
HISPARSE_ARGS = ("--enable-hisparse", "--disable-radix-cache",
                 "--hisparse-config", json.dumps({"top_k": 512, "device_buffer_size": HOT}))
STARTUP_S = float(os.environ.get("FLASHMEMORY_LIVE_STARTUP_S", "900"))


def _prompt() -> list[int]:
    rng = random.Random(19)
    return [rng.randrange(26, 1024) for _ in range(PROMPT_LEN)]


def _dry_run(script: str, env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment and command a launch script would run (its DRY_RUN=1 output)."""
    out = subprocess.run(["bash", str(REPO / script)], env={**env, "DRY_RUN": "1"}, capture_output=True,
                         text=True, check=True).stdout
    names, cmd = {}, []
    for line in out.splitlines():
        if line.startswith("ENV "):
            k, _, v = line[4:].partition("=")
            names[k] = shlex.split(v)[0] if v else ""
        elif line.startswith("CMD "):
            cmd = shlex.split(line[4:])
    assert cmd, f"{script} DRY_RUN printed no command:\n{out}"
    return names, cmd


@pytest.fixture(scope="module")
def hisparse_stack(serving_model, live_logs):
    """P + HiSparse D + router on 127.0.0.1, Mooncake over TCP; every process stopped at teardown."""
    d_port, p_port, boot, r_port, prom = free_ports(5)
    base = {**os.environ, "DEVICE": "cpu", "MODEL": str(serving_model), "TRANSFER_BACKEND": "mooncake",
            "MOONCAKE_PROTOCOL": "tcp", "BOOTSTRAP_PORT": str(boot), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "no_proxy": "127.0.0.1,localhost"}
    d_env, d_cmd = _dry_run("launch_decode.sh", {**base, "PORT": str(d_port), "FLASHMEMORY": "0"})
    servers = Servers(Path(live_logs) / "hisparse")
    try:
        d = servers.start("decode", [*d_cmd, *HISPARSE_ARGS],
                          {**base, **d_env, "SGLANG_PLUGINS": "flashmemory_cpu"})
        p = servers.start("prefill", ["bash", str(REPO / "launch_prefill.sh")], {**base, "PORT": str(p_port)})
        d_url, p_url = f"http://127.0.0.1:{d_port}", f"http://127.0.0.1:{p_port}"
        servers.wait_http(d, d_url + "/health", STARTUP_S)
        servers.wait_http(p, p_url + "/health", STARTUP_S)
        r = servers.start("router", ["bash", str(REPO / "launch_router.sh")],
                          {**base, "PORT": str(r_port), "PREFILL_IP": "127.0.0.1", "PREFILL_PORT": str(p_port),
                           "DECODE_IP": "127.0.0.1", "DECODE_PORT": str(d_port), "PROMETHEUS_PORT": str(prom)})
        r_url = f"http://127.0.0.1:{r_port}"
        servers.wait_http(r, r_url + "/readiness", STARTUP_S, ok=router_ready)
        yield {"router": r_url, "decode": d_url, "prefill": p_url, "servers": servers}
    finally:
        servers.stop()
    assert not servers.leftovers()


def _swapin(decode_url: str) -> dict[str, float]:
    status, body = http_get(decode_url + "/metrics", timeout=10)
    assert status == 200, f"{decode_url}/metrics answered {status}"
    m = parse_metrics(body.decode(errors="replace"), prefix="flashmemory_hisparse_swapin_")
    return {k.removeprefix("flashmemory_hisparse_swapin_").removesuffix("_total"): v for k, v in m.items()
            if k.endswith("_total")}


def test_hisparse_decodes_stock_tokens_with_counted_swapins(hisparse_stack, live_servers):
    ids = _prompt()
    stock = generate(live_servers["stock"].url, ids, NEW_TOKENS)
    got = generate(hisparse_stack["router"], ids, NEW_TOKENS)
    counts = _swapin(hisparse_stack["decode"])
    assert got == stock, f"HiSparse D {got} != stock {stock} (counters {counts})"
    assert counts.get("misses", 0) > 0 and counts.get("calls", 0) > 0, counts
    assert counts["bytes_h2d"] == counts["misses"] * 584, counts
    assert counts["hits"] > 0, counts     # later steps find most of the picks in the hot buffer
