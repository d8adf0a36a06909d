"""A PD stack on this machine through the project's own launch scripts: D, P and the router, DEVICE=cpu.

`start_pd` runs `launch_decode.sh` and `launch_prefill.sh` at once (their startup is mostly imports; the two
overlap), waits for both, then `launch_router.sh`, and returns the URLs and the measured startup seconds. The
ports of all five listeners (P, D, the KV bootstrap, the router and its Prometheus) are chosen together before
anything starts (`validate.stack_ports`), below the kernel's ephemeral range (see `procs.PORT_RANGE`); a fixed
router port that is taken is refused at once, naming it; a start that still hits "address already in use" on a
picked port (another stack started beside this one) is retried with fresh ports. The start-up timeout and D's
`--max-running-requests` against FlashMemory's row limit are checked first (`validate`).
Every process is owned by the `Servers` object passed in, which stops them all as process groups.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from flashmemory.errors import UserError
from flashmemory.serve.procs import (
    RENDEZVOUS_VAR,
    Servers,
    ServerStartError,
    is_loopback_host,
    port_clash,
    rendezvous_store,
)
from flashmemory.serve.validate import (
    StackPorts,
    check_concurrency,
    check_port,
    check_timeout,
    max_running_requests,
    stack_ports,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CPU_MODEL = REPO / "checkpoints" / "tiny-dsv4-sglang"  # FM_CPU_MODEL in scripts/launch_common.sh


def ensure_model(path: Path, swa_window: int | None = None) -> Path:
    """The serving-tiny checkpoint at `path`, built (seeded, deterministic) if it is not there yet. A directory
    with a config.json must be a checkpoint sglang can serve (`model_check`), else UserError naming the field.
    swa_window: the window the servers' CPU window row will set (0: none); None: this process's
    SGLANG_FLASHMEMORY_CPU_SWA_WINDOW, which the servers inherit."""
    from flashmemory.serve.model_check import check_serving_model

    if swa_window is None:
        from flashmemory.env import cpu_tiny_geometry

        swa_window = cpu_tiny_geometry().swa_window
    if not (path / "config.json").is_file():
        from flashmemory.hf.serving_build import build_serving

        print(f"building the tiny serving model at {path} (once) ...", flush=True)
        path = Path(build_serving(path))
    return check_serving_model(path, swa_window)


def retriever_dir(model: Path) -> Path:
    """Where `ensure_retriever` keeps the retriever built for the serving model at `model` (beside it)."""
    return model.parent / f"{model.name}-retriever"


def ensure_retriever(model: Path) -> Path:
    """A Level-1 retriever checkpoint trained for the serving model at `model`, trained once (about a minute,
    seeded) and kept beside the model like the model itself; later calls return it at once.

    Trained into a temporary sibling and renamed into place, under a lock, so an interrupted or concurrent
    first start never leaves (or reads) half a checkpoint. Returns the checkpoint file."""
    import fcntl

    from flashmemory.serve.tiny_retriever import train_tiny_retriever
    from flashmemory.train.loop import BEST_F1

    final = retriever_dir(model)
    ckpt = final / "ckpt" / BEST_F1
    if ckpt.is_file():
        return ckpt
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ckpt.is_file():  # built by a concurrent start while this one waited
            return ckpt
        # our own temporaries only (this name, under this lock): left by a start that was killed mid-training
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        print(f"training a Level-1 retriever for {model} at {final} (once, about a minute) ...", flush=True)
        try:
            built = train_tiny_retriever(model, tmp)
            if built != tmp / "ckpt" / BEST_F1 or not built.is_file():
                raise RuntimeError(f"retriever training for {model} left no checkpoint at {built}")
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ckpt


@dataclass(frozen=True)
class PDConfig:
    """What to start. `decode_env` / `prefill_env` are extra knobs for the launch scripts (CKPT, KMAX, ...)."""

    model: Path = DEFAULT_CPU_MODEL
    python: str = sys.executable
    host: str = "127.0.0.1"
    transfer_backend: str = "nixl"
    flashmemory: bool = True  # False: stock decode (FLASHMEMORY=0)
    decode_env: Mapping[str, str] = field(default_factory=dict)
    prefill_env: Mapping[str, str] = field(default_factory=dict)
    base_env: Mapping[str, str] | None = None  # the environment the scripts inherit (default: os.environ)
    startup_timeout: float = 420.0
    launch_dir: Path = REPO  # where launch_{decode,prefill,router}.sh are (tests use stand-ins)
    decode_args: tuple[str, ...] = ()  # extra sglang flags for D (after launch_decode.sh's own)


HISPARSE_HOT = 512  # hot-buffer slots per c4 layer per request: the model's index_topk, HiSparse's least


def hisparse_config(cfg: PDConfig, hot: int = HISPARSE_HOT, top_k: int = 512) -> PDConfig:
    """`cfg` with D as sglang's own HiSparse (stock decode, `--enable-hisparse`, a hot buffer of `hot` c4 slots
    per layer and request) and KV moved by Mooncake over TCP: HiSparse's DSv4 PD path accepts only Mooncake
    (sglang decode.py:1809). D loads only the CPU layer plugin (its torch swap-in), nothing of FlashMemory."""
    mooncake = {"MOONCAKE_PROTOCOL": "tcp"}
    return replace(
        cfg,
        flashmemory=False,
        transfer_backend="mooncake",
        decode_env={**cfg.decode_env, **mooncake, "CKPT": "", "SGLANG_PLUGINS": "flashmemory_cpu"},
        prefill_env={**cfg.prefill_env, **mooncake},
        decode_args=(
            *cfg.decode_args,
            "--enable-hisparse",
            "--disable-radix-cache",
            "--hisparse-config",
            json.dumps({"top_k": top_k, "device_buffer_size": hot}),
        ),
    )


@dataclass
class PDStack:
    router_url: str
    prefill_url: str
    decode_url: str
    startup_s: dict[str, float]


def _env(cfg: PDConfig, **knobs: str) -> dict[str, str]:
    e = dict(os.environ if cfg.base_env is None else cfg.base_env)
    e.pop("DRY_RUN", None)
    e.update(
        DEVICE="cpu",
        PYTHON=cfg.python,
        MODEL=str(cfg.model),
        HOST=cfg.host,
        OMP_NUM_THREADS="1",
        no_proxy=f"127.0.0.1,localhost{',' + e['no_proxy'] if e.get('no_proxy') else ''}",
    )
    # children must import this checkout's flashmemory (a worktree, or a clone without `pip install -e`)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    e.update(knobs)
    if is_loopback_host(cfg.host):  # a named rendezvous store per server, removed when Servers stops it
        e.setdefault(RENDEZVOUS_VAR, rendezvous_store(uuid.uuid4().hex))
    return e


def router_ready(status: int, body: bytes, workers: int = 2) -> bool:
    """sglang_router's /readiness: 200 with every one of the `workers` registered workers healthy."""
    if status != 200:
        return False
    try:
        r = json.loads(body)
    except ValueError:
        return False
    return (
        r.get("status") == "ready"
        and int(r.get("healthy_workers", 0)) >= workers
        and r.get("healthy_workers") == r.get("total_workers")
    )


PORT_ATTEMPTS = 3


def start_pd(servers: Servers, cfg: PDConfig, router_port: int | None = None, attempts: int = PORT_ATTEMPTS) -> PDStack:
    """Start D, P (together), then the router; wait until each answers. Raises `ServerStartError` with a log tail.

    Ports: the router's is `router_port` if given, every other one is picked free, all together. A start that
    fails because a picked port was taken meanwhile is stopped and retried with fresh ports (up to `attempts` in
    all), with a message; a fixed router port that is taken is a UserError naming it, never retried."""
    check_stack(cfg, router_port)
    prepare_loopback_shim(cfg)
    for attempt in range(1, attempts + 1):
        first = len(servers.procs)
        ports = stack_ports(cfg.host, router_port)
        try:
            return _start_pd_once(servers, cfg, ports)
        except ServerStartError:
            mine = servers.procs[first:]
            clashed = [p.name for p in mine if port_clash(p.log_text())]
            if router_port and "router" in clashed:
                servers.stop(only=mine)
                raise UserError(
                    f"--port {router_port}: taken by another process while the stack started; choose "
                    "another port, or 0 for any free one"
                ) from None
            if not clashed or attempt == attempts:
                raise
            servers.stop(only=mine)
            print(
                f"port clash ({', '.join(clashed)}: address already in use); retrying with fresh ports "
                f"(attempt {attempt + 1}/{attempts}) ...",
                flush=True,
            )
    raise AssertionError("unreachable")


def check_stack(cfg: PDConfig, router_port: int | None) -> None:
    """Refuse, in one line naming the flag, what would make a start fail later: a start-up timeout that is not a
    positive number, a fixed router port that is out of range or taken, and D's `--max-running-requests` above
    FlashMemory's row limit (launch_decode.sh sets SGLANG_PATHP_DECODE_MAX_CONC from MAX_RUN, 4 on CPU)."""
    check_timeout(cfg.startup_timeout, "--startup-timeout")
    check_port(router_port or 0, cfg.host, "--port")
    if cfg.flashmemory:
        base = os.environ if cfg.base_env is None else cfg.base_env
        raw = cfg.decode_env.get("MAX_RUN") or base.get("MAX_RUN") or "4"
        try:
            limit = int(raw)
        except ValueError:
            raise UserError(f"MAX_RUN={raw!r}: expected a whole number") from None
        check_concurrency(max_running_requests(cfg.decode_args), limit, "MAX_RUN (SGLANG_PATHP_DECODE_MAX_CONC)")


def prepare_loopback_shim(cfg: PDConfig) -> bool:
    """On a local-only stack (loopback host, no --dist-init-addr) moving KV with Mooncake, build the loopback-bind
    shim now, once, rather than in P and D as they start together (`fm_loopback_shim` in the launch scripts
    finds it built and preloads it). When it cannot be built, print the one warning line saying what stays open
    and how to firewall it. True when the shim is (or need not be) in place."""
    if not cfg.transfer_backend.startswith("mooncake") or not is_loopback_host(cfg.host):
        return True
    if any(a.startswith("--dist-init-addr") for a in cfg.decode_args):
        return True
    from flashmemory.serve.loopback import ShimUnavailable, shim_path

    try:
        shim_path()
    except ShimUnavailable as e:
        print(f"warning: {e}", file=sys.stderr, flush=True)
        return False
    return True


def _start_pd_once(servers: Servers, cfg: PDConfig, ports: StackPorts) -> PDStack:
    p_port, d_port, boot_port = ports.prefill, ports.decode, ports.bootstrap
    common = dict(TRANSFER_BACKEND=cfg.transfer_backend, BOOTSTRAP_PORT=str(boot_port))
    d = servers.start(
        "decode",
        ["bash", str(cfg.launch_dir / "launch_decode.sh"), *cfg.decode_args],
        _env(cfg, PORT=str(d_port), FLASHMEMORY="1" if cfg.flashmemory else "0", **common, **dict(cfg.decode_env)),
    )
    p = servers.start(
        "prefill",
        ["bash", str(cfg.launch_dir / "launch_prefill.sh")],
        _env(cfg, PORT=str(p_port), **common, **dict(cfg.prefill_env)),
    )
    d_url, p_url = f"http://{cfg.host}:{d_port}", f"http://{cfg.host}:{p_port}"
    times = {
        "decode": servers.wait_http(d, d_url + "/health", cfg.startup_timeout),
        "prefill": servers.wait_http(p, p_url + "/health", cfg.startup_timeout),
    }
    t0 = time.monotonic()
    r_port, prom_port = ports.router, ports.prometheus
    r = servers.start(
        "router",
        ["bash", str(cfg.launch_dir / "launch_router.sh")],
        _env(
            cfg,
            PORT=str(r_port),
            PREFILL_IP=cfg.host,
            PREFILL_PORT=str(p_port),
            DECODE_IP=cfg.host,
            DECODE_PORT=str(d_port),
            BOOTSTRAP_PORT=str(boot_port),
            PROMETHEUS_PORT=str(prom_port),
        ),
    )
    r_url = f"http://{cfg.host}:{r_port}"
    # the router answers /health at once; /readiness says when it has found both workers healthy
    servers.wait_http(r, r_url + "/readiness", cfg.startup_timeout, ok=router_ready)
    times["router"] = time.monotonic() - t0
    return PDStack(r_url, p_url, d_url, times)
