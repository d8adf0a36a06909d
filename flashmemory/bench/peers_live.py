"""Live parts of `flashmemory bench peers`: start the four PD stacks, stream one round of requests with their
token ids, and sample D's gauges while it runs.

Stacks (each its own P, D and router, all through the project's launch scripts, DEVICE=cpu):
- stock: FLASHMEMORY=0, NIXL;
- hisparse: D = launch_decode.sh's command (FLASHMEMORY=0, its DRY_RUN output) plus --enable-hisparse, KV moved by
  Mooncake over TCP (sglang's HiSparse PD path refuses every other backend, decode.py:1809);
- flashmemory: Path-P in shrink mode over NIXL, as `bench serve` runs it;
- fm_monitor: the same plus SGLANG_RETRIEVER_MISS_MONITOR=1.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from flashmemory.serve.client import StreamResult, flashmemory_metrics, greedy_params
from flashmemory.serve.procs import ServerStartError, Servers, free_ports
from flashmemory.serve.stack import PDConfig, PDStack, _env, router_ready, start_pd


@dataclass(frozen=True)
class ArmSetup:
    """One arm's stack: the PD config and, for HiSparse, the extra arguments appended to D's command."""

    arm: str
    cfg: PDConfig
    decode_args: tuple[str, ...] = ()


def arm_setups(model: Path, ctx_len: int, max_total: int, max_run: int, kmax: int, ckpt: str,
               hot_buffer: int, topk: int, interval: int) -> list[ArmSetup]:
    """The four arms' stacks. Every server gets the same context length, pool (MAX_TOTAL_TOKENS) and
    max-running-requests, so only the decode-side mechanism differs."""
    knobs = {"CTX_LEN": str(ctx_len), "MAX_RUN": str(max_run), "MAX_TOTAL_TOKENS": str(max_total)}
    fm_env = dict(knobs, KMAX=str(kmax), LAST_KEEP="64", INTERVAL=str(interval), CKPT=ckpt)
    hs_args = ("--enable-hisparse", "--disable-radix-cache", "--hisparse-config",
               json.dumps({"top_k": topk, "device_buffer_size": hot_buffer}))
    base = PDConfig(model=model, decode_env=knobs, prefill_env=knobs)
    return [ArmSetup("stock", replace(base, flashmemory=False)),
            ArmSetup("hisparse", replace(base, flashmemory=False, transfer_backend="mooncake",
                                         decode_env=dict(knobs, MOONCAKE_PROTOCOL="tcp"),
                                         prefill_env=dict(knobs, MOONCAKE_PROTOCOL="tcp")), hs_args),
            ArmSetup("flashmemory", replace(base, decode_env=fm_env)),
            ArmSetup("fm_monitor", replace(base, decode_env=dict(fm_env, SGLANG_RETRIEVER_MISS_MONITOR="1")))]


def _dry_run_decode(cfg: PDConfig, port: int, boot: int) -> tuple[dict[str, str], list[str]]:
    """launch_decode.sh's environment and command (DRY_RUN=1) for a stock D on `port`."""
    env = _env(cfg, PORT=str(port), FLASHMEMORY="0", TRANSFER_BACKEND=cfg.transfer_backend,
               BOOTSTRAP_PORT=str(boot), DRY_RUN="1", **dict(cfg.decode_env))
    out = subprocess.run(["bash", str(cfg.launch_dir / "launch_decode.sh")], env=env, capture_output=True,
                         text=True)
    names, cmd = {}, []
    for line in out.stdout.splitlines():
        if line.startswith("ENV "):
            k, _, v = line[4:].partition("=")
            names[k] = shlex.split(v)[0] if v else ""
        elif line.startswith("CMD "):
            cmd = shlex.split(line[4:])
    if not cmd:
        raise ServerStartError(f"launch_decode.sh DRY_RUN printed no command: {out.stderr.strip()[-300:]}")
    env.pop("DRY_RUN")
    return {**env, **names}, cmd


def start_with_decode_args(servers: Servers, cfg: PDConfig, decode_args: tuple[str, ...]) -> PDStack:
    """Like `start_pd`, with `decode_args` appended to D's command (launch_decode.sh has no pass-through)."""
    if not decode_args:
        return start_pd(servers, cfg)
    p_port, d_port, boot = free_ports(3, cfg.host)
    d_env, d_cmd = _dry_run_decode(cfg, d_port, boot)
    d = servers.start("decode", [*d_cmd, *decode_args], d_env)
    p = servers.start("prefill", ["bash", str(cfg.launch_dir / "launch_prefill.sh")],
                      _env(cfg, PORT=str(p_port), TRANSFER_BACKEND=cfg.transfer_backend, BOOTSTRAP_PORT=str(boot),
                           **dict(cfg.prefill_env)))
    d_url, p_url = f"http://{cfg.host}:{d_port}", f"http://{cfg.host}:{p_port}"
    times = {"decode": servers.wait_http(d, d_url + "/health", cfg.startup_timeout),
             "prefill": servers.wait_http(p, p_url + "/health", cfg.startup_timeout)}
    t0 = time.monotonic()
    r_port, prom = free_ports(2, cfg.host)
    r = servers.start("router", ["bash", str(cfg.launch_dir / "launch_router.sh")],
                      _env(cfg, PORT=str(r_port), PREFILL_IP=cfg.host, PREFILL_PORT=str(p_port), DECODE_IP=cfg.host,
                           DECODE_PORT=str(d_port), BOOTSTRAP_PORT=str(boot), PROMETHEUS_PORT=str(prom)))
    r_url = f"http://{cfg.host}:{r_port}"
    servers.wait_http(r, r_url + "/readiness", cfg.startup_timeout, ok=router_ready)
    times["router"] = time.monotonic() - t0
    return PDStack(r_url, p_url, d_url, times)


def start_all(setups: list[ArmSetup], logs: Path) -> tuple[dict[str, Servers], dict[str, PDStack]]:
    """Start every arm's stack at once (one thread each). On any failure every started process is stopped and
    the first error is raised."""
    servers = {s.arm: Servers(logs / s.arm) for s in setups}
    stacks: dict[str, PDStack] = {}
    errors: list[BaseException] = []

    def one(s: ArmSetup) -> None:
        try:
            stacks[s.arm] = start_with_decode_args(servers[s.arm], s.cfg, s.decode_args)
            print(f"  arm {s.arm}: ready ({', '.join(f'{k} {v:.0f} s' for k, v in stacks[s.arm].startup_s.items())})",
                  flush=True)
        except BaseException as e:   # re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in setups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        stop_all(servers)
        raise errors[0]
    return servers, stacks


def stop_all(servers: dict[str, Servers]) -> list[int]:
    """Stop every arm's processes; the pids left alive (none after a clean stop)."""
    for s in servers.values():
        s.stop()
    return [p for s in servers.values() for p in s.leftovers()]


@dataclass
class Streamed:
    """One streamed request: its timing (StreamResult) and the output token ids seen so far."""

    result: StreamResult
    ids: list[int] = field(default_factory=list)


def stream_ids(url: str, input_ids: list[int], max_new: int, stop: Callable[[list[float]], bool],
               timeout: float = 3600.0) -> Streamed:
    """A streamed greedy /generate that keeps the output ids (cumulative or incremental chunks) and the arrival
    time of every new token; stop(token_times) True closes the stream (the server aborts the request)."""
    body = json.dumps({"input_ids": list(map(int, input_ids)), "sampling_params": greedy_params(max_new),
                       "stream": True}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    sent, times, ids, n = time.monotonic(), [], [], 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                if line[5:].strip() == "[DONE]":
                    break
                continue
            msg = json.loads(line[5:].strip())
            done = int((msg.get("meta_info") or {}).get("completion_tokens", n))
            got = [int(t) for t in msg.get("output_ids") or []]
            ids = got if len(got) >= done else ids + got     # cumulative by default; incremental otherwise
            if done > n:
                times.extend([time.monotonic()] * (done - n))
                n = done
                if stop(times):
                    break
    if n == 0:
        raise RuntimeError(f"{url}/generate streamed no tokens")
    return Streamed(StreamResult(sent, times, n), ids[:n])


def concurrent_round(url: str, prompts: list[list[int]], max_new: int, steady_tokens: int) -> list[Streamed]:
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
            out[i] = stream_ids(url, prompts[i], max_new, stopper(i))
        except BaseException as e:   # re-raised below, in the caller's thread
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
