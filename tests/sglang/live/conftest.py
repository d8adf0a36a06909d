"""Live sglang servers on CPU (SGLANG_FLASHMEMORY_CPU=1) for the tests in this folder.

One server per configuration, shared by a module (startup is 35-95 s here). Every server runs in its own
process group and carries a marker in its environment; teardown kills the group and the test session ends
by checking that no marked process is left. The tiny checkpoint is built once per session.
"""

import importlib.metadata
import os
import random
from contextlib import contextmanager
from pathlib import Path

import pytest

import flashmemory

pytestmark = pytest.mark.live
REPO = str(Path(flashmemory.__file__).resolve().parents[1])
_STARTED: list = []


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/sglang/live" in str(item.fspath):
            item.add_marker(pytest.mark.live)
            item.add_marker(pytest.mark.sglang)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def serving_model(tmp_path_factory):
    pytest.importorskip("sglang")
    eps = {ep.name for ep in importlib.metadata.entry_points(group="sglang.srt.platforms")}
    assert "flashmemory_cpu" in eps, (
        "the sglang.srt.platforms entry point 'flashmemory_cpu' is not installed: "
        "run `pip install --no-deps -e .` in the repo"
    )
    from flashmemory.hf.serving_build import build_serving

    return build_serving(tmp_path_factory.mktemp("serving") / "serving-tiny", seed=0)


@pytest.fixture(scope="session")
def live_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("live_logs")


@pytest.fixture(scope="session", autouse=True)
def no_process_left():
    """After the whole session: every server this folder started is gone, children included."""
    yield
    from flashmemory.serve.cpu_server import marked_processes

    left = {s.log.name: marked_processes(s.id) for s in _STARTED}
    for s in _STARTED:
        s.stop()
    assert not any(left.values()), f"sglang processes left behind: {left}"


def make_server(model, logs, name: str, env: dict | None = None, extra_args: tuple = ()):
    """A CpuServer with this repo on PYTHONPATH, launched now; registered for the leftover check."""
    from flashmemory.serve.cpu_server import CpuServer

    srv = CpuServer(model, Path(logs) / f"{name}.log", env=env, extra_args=extra_args, pythonpath=REPO)
    _STARTED.append(srv)
    return srv.launch()


STARTUP_S = float(os.environ.get("FLASHMEMORY_LIVE_STARTUP_S", "600"))
COMMON = {
    "SGLANG_RETRIEVER_INLINE_LAYERS": "0,1",
    "SGLANG_DSV4_TARGET_CONCURRENCY": "4",
    "SGLANG_PATHP_DECODE_MAX_CONC": "4",
    "SGLANG_PATHP_DECODE_RESIDENT_CHUNKS": "64",
    "SGLANG_RETRIEVER_INTERVAL": "4",
}
# (b) Path-P + Level 1 + score-resident Level 2; the recency tail (2048 chunks) and KMAX (16 pages of 64
# chunks) hold every chunk of these <= 1.2K-token requests, so nothing is ever evicted.
FULL_BUDGET = {
    **COMMON,
    "SGLANG_DECODE_SWAP_P": "1",
    "SGLANG_PATHP_SCORE_RESIDENT": "1",
    "SGLANG_PATHP_PAGE_KMAX": "16",
    "SGLANG_RETRIEVER_LAST_KEEP": "2048",
}
# (b') the same budget, but Level 1 decides what is resident: every chunk passes it (logit offset 30, threshold
# 1e-4) and the recency tail is 16 chunks, so a page is resident because a Level-1 cycle (every 4 steps) kept it.
LEVEL1_FULL = {
    **FULL_BUDGET,
    "SGLANG_RETRIEVER_LAST_KEEP": "16",
    "SGLANG_RETRIEVER_LOGIT_OFFSET": "30",
    "SGLANG_RETRIEVER_SIGMOID_THRESH": "0.0001",
}
# (c) the same features at a small budget: two resident pages (of 64 chunks) per request, one of them the page
# the 16-chunk recency tail is on, the other the retriever's pick: 13-25% of the (c) requests' 8-15 pages.
# Level 1 runs synchronously here (the cycle's recall is published before the next step): at a small budget the
# tokens depend on the step a recall lands at, so only a synchronous cycle lets the disk-tier server below decode
# the same tokens. The asynchronous cycle (the default) runs live in test_live_pd and test_full_budget_equals_stock.
SMALL_BUDGET = {
    **FULL_BUDGET,
    "SGLANG_PATHP_PAGE_KMAX": "2",
    "SGLANG_RETRIEVER_LAST_KEEP": "16",
    "SGLANG_PATHP_ASYNC_RECALL": "0",
}
SMALL_ARGS = ("--max-total-tokens", "16384")  # the three (c) requests hold 8.4K tokens at once
# The miss monitor runs on the full-budget server (test_monitor_live: every reading there must be 0, and the
# monitor must not change tokens: test_full_budget_equals_stock). The test-only fault injector runs on the small
# one and faults only requests named faulty-* (test_fault_injection). Sharing servers keeps the suite in budget.
MONITOR = {"SGLANG_RETRIEVER_MISS_MONITOR": "1"}
FAULT = {"FLASHMEMORY_FAULT_INJECT": "hook=before_forward,rid=^faulty-"}
# (c) + the disk tier (test_disk_tier): an 80 KB host page cache (1 of the tiny model's 74,880-B pages), far
# smaller than the requests' sealed pages, so pages are written behind to the store and recalls read them back
# (with 4 pages and synchronous Level 1 every recalled page was still in the cache: nothing was read from disk).
DISK_CACHE_GB = "0.00008"
# The host mirror as a landing window: 1 MB, so the floor of max_rows x 3 = 12 page slots (of 74,880 B) holds it,
# against the mirror's one slot per page id without the window. Sealed pages live in the tier only.
MIRROR_WINDOW_GB = "0.001"


def disk_tier_env(disk_dir: Path) -> dict:
    return {
        **SMALL_BUDGET,
        "SGLANG_PATHP_DISK_DIR": str(disk_dir),
        "SGLANG_PATHP_DISK_GB": "0.1",
        "SGLANG_PATHP_HOST_CACHE_GB": DISK_CACHE_GB,
        "SGLANG_PATHP_HOST_MIRROR_GB": MIRROR_WINDOW_GB,
    }


@pytest.fixture(scope="session")
def tiny_retriever_ckpt(serving_model, tmp_path_factory):
    """A retriever trained here from a dump of the serving model (about half a minute), shared by the session.
    Trained into a *relative* output dir from another working directory, as `make demo` does: a data config
    written with cwd-relative paths once broke the demo's serving stage on a clean clone."""
    from flashmemory.serve.tiny_retriever import train_tiny_retriever

    base = tmp_path_factory.mktemp("retriever")
    cwd = os.getcwd()
    os.chdir(base)
    try:
        return str(base / train_tiny_retriever(serving_model, Path("work") / "serve_retriever"))
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="session")
def stock_server(serving_model, live_logs):
    """The folder's plain stock server (the CPU layer only, no FlashMemory, no PD): every live test's reference.
    Launched without waiting, so a caller can start its own servers beside it; `wait_ready` before use."""
    srv = make_server(serving_model, live_logs, "stock", env={"SGLANG_PLUGINS": "flashmemory_cpu"})
    try:
        yield srv
    finally:
        srv.stop()
    assert not srv.leftovers()


@pytest.fixture(scope="package")
def live_servers(serving_model, live_logs, tiny_retriever_ckpt, stock_server):
    """Every live configuration, started in parallel (startup is mostly imports): stock (`stock_server`, the CPU
    layer only), gates off (plugin loaded, nothing on), full (b, with the miss monitor) and small (c, with the
    fault injector) budgets with a retriever trained here. (The disk-tier server is test_disk_tier's own.)
    Package scope: they stop after this folder's last test, not at the end of the whole session; the modules
    that start servers of their own (test_live_pd's two PD stacks) run before these start (tests/conftest.py)."""
    off = make_server(serving_model, live_logs, "gates_off")
    ckpt = tiny_retriever_ckpt
    full = make_server(
        serving_model, live_logs, "full_budget", env={**LEVEL1_FULL, **MONITOR, "SGLANG_RETRIEVER_INLINE_CKPT": ckpt}
    )
    small = make_server(
        serving_model,
        live_logs,
        "small_budget",
        env={**SMALL_BUDGET, **FAULT, "SGLANG_RETRIEVER_INLINE_CKPT": ckpt},
        extra_args=SMALL_ARGS,
    )
    servers = {"stock": stock_server, "off": off, "full": full, "small": small}
    mine = (off, full, small)
    try:
        for s in servers.values():
            s.wait_ready(STARTUP_S)
        yield servers
    finally:
        side_by_side(*(s.stop for s in mine))  # each stop waits for its group to exit: wait for all at once
    assert not any(s.leftovers() for s in mine)


def side_by_side(*calls):
    """Run the zero-argument `calls` at once, one thread each (each on its own server, so both cores work);
    their results in order. The first exception is raised after all have ended. Only for calls whose tokens do not
    depend on timing: one request or one batched call per server, or Level 1 synchronous."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as ex:
        futures = [ex.submit(c) for c in calls]
    return [f.result() for f in futures]


def prompt(n: int, seed: int) -> list[int]:
    """n token ids drawn from the ordinary (non-special) vocabulary of the serving-tiny tokenizer."""
    rng = random.Random(seed)
    return [rng.randrange(26, 1024) for _ in range(n)]


def shm_segments() -> set[str]:
    """sglang's shared-memory message queues in /dev/shm (a multi-rank server makes them)."""
    return {p for p in os.listdir("/dev/shm") if p.startswith("sgl_shm_mq_")}


def small_init_model(tmp_path_factory, name: str) -> Path:
    """A small-init copy of the tiny DSv4 (init_std 0.02: far less chaotic than the default weights, so bf16
    rounding does not flip greedy tokens between runs that compute the same bits)."""
    from flashmemory.hf.serving_build import build_serving

    return build_serving(tmp_path_factory.mktemp(name) / "serving-tiny-std002", seed=0, init_std=0.02)


@contextmanager
def server_trio(model, logs, name: str, layout: tuple, full_env: dict, small_env: dict, small_layout: tuple = ()):
    """Three servers of one multi-rank `layout`, started in parallel: `stock` (the CPU layer only), `full`
    (LEVEL1_FULL + `full_env`) and `small` (a three-page budget, asynchronous Level 1, + `small_env`; launched
    with `small_layout` when given, with SMALL_ARGS). Yields them by name; afterwards every one is stopped, and
    none may leave a process or a shared-memory queue (the queues present before were not theirs)."""
    before = shm_segments()  # CpuServer.stop removes the queues its servers leave; others' are not ours
    stock = make_server(model, logs, f"{name}_stock", env={"SGLANG_PLUGINS": "flashmemory_cpu"}, extra_args=layout)
    full = make_server(model, logs, f"{name}_full", env={**LEVEL1_FULL, **full_env}, extra_args=layout)
    small_base = {**SMALL_BUDGET, "SGLANG_PATHP_PAGE_KMAX": "3", "SGLANG_PATHP_ASYNC_RECALL": "1"}
    small = make_server(
        model, logs, f"{name}_small", env={**small_base, **small_env}, extra_args=(small_layout or layout) + SMALL_ARGS
    )
    servers = (stock, full, small)
    try:
        for s in servers:
            s.wait_ready(STARTUP_S)
        yield {"stock": stock, "full": full, "small": small}
    finally:
        side_by_side(*(s.stop for s in servers))
    assert not any(s.leftovers() for s in servers)
    assert shm_segments() <= before, f"shared-memory message queues of the {name} servers were left in /dev/shm"
