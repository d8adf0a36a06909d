"""Live parts of `flashmemory bench peers`: start the arms' PD stacks, stream one round of requests with their
token ids, and sample D's gauges while it runs.

Stacks: one P per transfer backend, shared by the arms on it, and one D per arm (no router: `stream_ids` pairs
P and D itself); all through the project's launch scripts, DEVICE=cpu (four full stacks at once, 8 sglang
servers and 4 routers, did not fit the box's memory):
- stock: FLASHMEMORY=0, NIXL;
- hisparse: `stack.hisparse_config`, as `flashmemory serve --hisparse`: stock D plus --enable-hisparse (passed
  through launch_decode.sh), KV moved by Mooncake over TCP (HiSparse's PD path refuses other backends, decode.py:1809);
- hs_prefetch: the hisparse stack with D loading the FlashMemory plugin in its HiSparse prefetch mode
  (SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1) and the retriever checkpoint, so Level 1 is the hint source (Path-P
  off), as `tests/sglang/live/test_hisparse_prefetch_live.py` runs it;
- hisparse and hs_prefetch: one D per hot-buffer size (`arm_key`: 'hisparse@640');
- flashmemory: Path-P in shrink mode over NIXL, as `bench serve` runs it;
- fm_monitor: the same plus SGLANG_RETRIEVER_MISS_MONITOR=1.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from flashmemory.bench.peers_costs import HOT_ARMS, arm_key
from flashmemory.serve.client import StreamResult, flashmemory_metrics, greedy_params
from flashmemory.serve.procs import Servers, free_ports, http_post_json
from flashmemory.serve.stack import PDConfig, _env, hisparse_config


@dataclass(frozen=True)
class PDPair:
    """An arm's P and D: a request goes to both with the same bootstrap fields (what sglang's router adds: P's
    host and bootstrap port, a random room) and D streams the tokens."""

    prefill_url: str
    decode_url: str
    bootstrap_host: str
    bootstrap_port: int
    startup_s: dict[str, float]

    def bootstrap(self) -> dict[str, object]:
        return {
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.getrandbits(63),
        }


@dataclass(frozen=True)
class ArmSetup:
    """One arm's stack: its name and PD config (HiSparse's flags ride in `cfg.decode_args`)."""

    arm: str
    cfg: PDConfig


def arm_setups(
    model: Path,
    ctx_len: int,
    max_total: int,
    max_run: int,
    kmax: int,
    ckpt: str,
    buffers: list[int],
    topk: int,
    interval: int,
    arms: tuple[str, ...],
) -> list[ArmSetup]:
    """The stacks of `arms` (names of peers_costs.ARMS), a hot-buffer arm once per size in `buffers` (keyed
    'hisparse@576' when there are two sizes, by its bare name with one). Every server gets the same context
    length, pool (MAX_TOTAL_TOKENS) and max-running-requests, so only the decode-side mechanism differs."""
    knobs = {"CTX_LEN": str(ctx_len), "MAX_RUN": str(max_run), "MAX_TOTAL_TOKENS": str(max_total)}
    fm_env = dict(knobs, KMAX=str(kmax), LAST_KEEP="64", INTERVAL=str(interval), CKPT=ckpt)
    # startup: 6 servers at once on a shared 2-core box took over 7 minutes
    base = PDConfig(model=model, decode_env=knobs, prefill_env=knobs, startup_timeout=1800.0)
    out = []
    for arm in arms:
        if arm in HOT_ARMS:
            for b in buffers:
                cfg = hisparse_config(base, b, topk)  # what `flashmemory serve --hisparse` runs
                if arm == "hs_prefetch":
                    cfg = replace(
                        cfg,
                        decode_env={
                            **cfg.decode_env,
                            "SGLANG_PLUGINS": "flashmemory_cpu,flashmemory",
                            "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "1",
                            "CKPT": ckpt,
                            "INTERVAL": str(interval),
                        },
                    )
                out.append(ArmSetup(arm_key(arm, b if len(buffers) > 1 else None), cfg))
        elif arm == "stock":
            out.append(ArmSetup("stock", replace(base, flashmemory=False)))
        elif arm == "flashmemory":
            out.append(ArmSetup("flashmemory", replace(base, decode_env=fm_env)))
        elif arm == "fm_monitor":
            monitor = dict(fm_env, SGLANG_RETRIEVER_MISS_MONITOR="1")
            out.append(ArmSetup("fm_monitor", replace(base, decode_env=monitor)))
        else:
            raise ValueError(f"unknown arm {arm!r}")
    return out


def _decode_cmd(cfg: PDConfig, port: int, boot: int) -> tuple[dict[str, str], list[str]]:
    """D's environment and argv: launch_decode.sh with the config's extra sglang flags."""
    return (
        _env(
            cfg,
            PORT=str(port),
            FLASHMEMORY="1" if cfg.flashmemory else "0",
            TRANSFER_BACKEND=cfg.transfer_backend,
            BOOTSTRAP_PORT=str(boot),
            **dict(cfg.decode_env),
        ),
        ["bash", str(cfg.launch_dir / "launch_decode.sh"), *cfg.decode_args],
    )


def start_all(setups: list[ArmSetup], logs: Path) -> tuple[Servers, dict[str, "PDPair"]]:
    """One P per transfer backend (the arms on the same backend share it: memory, and their prompts are
    prefilled once) and one D per arm, all started at once. No router: a router per arm took about a minute each
    to start and 0.7 GB each, which the box did not have; `stream_ids` pairs P and D itself, as the router does.
    On any failure every started process is stopped and the error raised."""
    servers = Servers(logs)
    try:
        host = setups[0].cfg.host
        prefills: dict[str, tuple[str, int, object]] = {}
        for s in setups:
            b = s.cfg.transfer_backend
            if b not in prefills:
                p_port, boot = free_ports(2, host)
                proc = servers.start(
                    f"prefill_{b}",
                    ["bash", str(s.cfg.launch_dir / "launch_prefill.sh")],
                    _env(
                        s.cfg, PORT=str(p_port), TRANSFER_BACKEND=b, BOOTSTRAP_PORT=str(boot), **dict(s.cfg.prefill_env)
                    ),
                )
                prefills[b] = (f"http://{host}:{p_port}", boot, proc)
        decodes = {}
        for s in setups:
            (d_port,) = free_ports(1, host)
            env, argv = _decode_cmd(s.cfg, d_port, prefills[s.cfg.transfer_backend][1])
            decodes[s.arm] = (f"http://{host}:{d_port}", servers.start(f"decode_{s.arm}", argv, env))
        times = {}
        for b, (url, _, proc) in prefills.items():
            times[f"prefill_{b}"] = servers.wait_http(proc, url + "/health", setups[0].cfg.startup_timeout)
        for arm, (url, proc) in decodes.items():
            times[arm] = servers.wait_http(proc, url + "/health", setups[0].cfg.startup_timeout)
            print(f"  D of arm {arm}: ready after {times[arm]:.0f} s", flush=True)
        stacks = {}
        for s in setups:
            p_url, boot, _ = prefills[s.cfg.transfer_backend]
            stacks[s.arm] = PDPair(p_url, decodes[s.arm][0], host, boot, dict(times))
        return servers, stacks
    except BaseException:
        servers.stop()
        raise


def stop_all(servers: Servers) -> list[int]:
    """Stop every process of the run; the pids left alive (none after a clean stop)."""
    servers.stop()
    return servers.leftovers()


@dataclass
class Streamed:
    """One streamed request: its timing (StreamResult) and the output token ids seen so far."""

    result: StreamResult
    ids: list[int] = field(default_factory=list)


def stream_ids(
    pd: PDPair, input_ids: list[int], max_new: int, stop: Callable[[list[float]], bool], timeout: float = 3600.0
) -> Streamed:
    """A streamed greedy PD request (P prefills, D decodes and streams) that keeps the output ids (cumulative or
    incremental chunks) and the arrival time of every new token; stop(token_times) True closes D's stream (D
    aborts the request)."""
    rid = f"peers-{random.getrandbits(48):012x}"
    payload = {
        "input_ids": list(map(int, input_ids)),
        "sampling_params": greedy_params(max_new),
        "rid": rid,
        **pd.bootstrap(),
    }
    p_err: list[BaseException] = []

    def prefill() -> None:
        try:
            http_post_json(pd.prefill_url + "/generate", payload, timeout=timeout)
        except BaseException as e:  # reported below if D streamed nothing
            p_err.append(e)
            try:  # D would wait for this request's KV until `timeout`: end its stream now
                http_post_json(pd.decode_url + "/abort_request", {"rid": rid}, timeout=30)
            except (OSError, ValueError):
                pass

    pt = threading.Thread(target=prefill, daemon=True)
    pt.start()
    body = json.dumps({**payload, "stream": True}).encode()
    req = urllib.request.Request(pd.decode_url + "/generate", data=body, headers={"Content-Type": "application/json"})
    sent, times, ids, n = time.monotonic(), [], [], 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            if line[5:].strip() == "[DONE]":
                break
            msg = json.loads(line[5:].strip())
            done = int((msg.get("meta_info") or {}).get("completion_tokens", n))
            got = [int(t) for t in msg.get("output_ids") or []]
            ids = got if len(got) >= done else ids + got  # cumulative by default; incremental otherwise
            if done > n:
                times.extend([time.monotonic()] * (done - n))
                n = done
                if stop(times):
                    break
    pt.join(timeout=60)
    if n == 0:
        raise RuntimeError(
            f"{pd.decode_url}/generate streamed no tokens" + (f" (prefill: {p_err[0]})" if p_err else "")
        )
    return Streamed(StreamResult(sent, times, n), ids[:n])


def concurrent_round(pd: PDPair, prompts: list[list[int]], max_new: int, steady_tokens: int) -> list[Streamed]:
    """Stream every prompt at once; once all are decoding each stream stops `steady_tokens` tokens later (on 2
    cores the prefills run one after another: without the stop the first requests finish before the last
    starts)."""
    n = len(prompts)
    out: list[Streamed | BaseException | None] = [None] * n
    lock, started, all_in = threading.Lock(), set(), [float("inf")]

    def stopper(i: int) -> Callable[[list[float]], bool]:
        def stop(times: list[float]) -> bool:
            with lock:
                if i not in started:
                    started.add(i)
                    if len(started) == n:
                        all_in[0] = times[0]
                t0 = all_in[0]
            return sum(t > t0 for t in times) >= steady_tokens

        return stop

    def one(i: int) -> None:
        try:
            out[i] = stream_ids(pd, prompts[i], max_new, stopper(i))
        except BaseException as e:  # re-raised below, in the caller's thread
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out  # type: ignore[return-value]


class GaugeSampler:
    """Samples D's flashmemory_* gauges once a second while a round runs; keeps the resident fraction and the
    mean page budget from samples taken while all `n` requests were live (FlashMemory arms only)."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n = url, n
        self.resident: list[float] = []
        self.budget: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                m = flashmemory_metrics(self.url)
            except (OSError, RuntimeError):
                continue
            if m.get("flashmemory_live_requests") == self.n:
                if "flashmemory_resident_fraction" in m:
                    self.resident.append(m["flashmemory_resident_fraction"])
                if "flashmemory_budget_pages_mean" in m:
                    self.budget.append(m["flashmemory_budget_pages_mean"])

    def __enter__(self) -> "GaugeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
