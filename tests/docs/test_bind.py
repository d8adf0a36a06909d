"""Every server the project starts binds 127.0.0.1 unless the user passes a host: the launch scripts (their
DRY_RUN command, GPU and CPU defaults), the dump server, and `flashmemory serve` (the environment it hands the
scripts). An inherited HOST does not leak into `flashmemory serve`; an explicit HOST opens a script. Internal
listeners too: the scripts' loopback defaults (the loopback-bind shim they preload for Mooncake is
test_loopback_shim.py's)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.doccheck import ROOT

SCRIPTS = ["launch_prefill.sh", "launch_decode.sh", "launch_router.sh", "data_generation/start_dump_server.sh"]
HOST_FLAGS = ("--host", "--prometheus-host")


BIND_VARS = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": "file://",
}
SGLANG_SCRIPTS = ["launch_prefill.sh", "launch_decode.sh", "data_generation/start_dump_server.sh"]


def dry_run(script: str, device: str, *args: str, **env: str) -> tuple[list[str], dict[str, str]]:
    """The script's DRY_RUN command (argv) and the environment it exports ({name: value})."""
    base = {k: v for k, v in os.environ.items() if k not in ("HOST", "DEVICE", "DRY_RUN", "LD_PRELOAD", *BIND_VARS)}
    extra = {"DUMP_ROOT": "/tmp"} if "dump" in script else {}
    p = subprocess.run(
        ["bash", str(ROOT / script), *args],
        env={**base, **extra, "DRY_RUN": "1", "DEVICE": device, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    cmd = shlex.split(next(ln for ln in lines if ln.startswith("CMD "))[4:])
    exported = dict(shlex.split(ln[4:])[0].split("=", 1) for ln in lines if ln.startswith("ENV "))
    return cmd, exported


def bound_hosts(script: str, device: str, **env: str) -> dict[str, str]:
    """The host flags of the script's DRY_RUN command ({flag: address})."""
    cmd, _ = dry_run(script, device, **env)
    return {f: cmd[i + 1] for i, f in enumerate(cmd) if f in HOST_FLAGS}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_default_bind_is_localhost(script: str, device: str) -> None:
    hosts = bound_hosts(script, device)
    assert "--host" in hosts, hosts
    assert set(hosts.values()) == {"127.0.0.1"}, hosts


@pytest.mark.parametrize("script", SCRIPTS)
def test_host_opens_a_server(script: str) -> None:
    assert set(bound_hosts(script, "cuda", HOST="0.0.0.0").values()) == {"0.0.0.0"}


def _bind_vars(exported: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in exported.items() if k in BIND_VARS}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("script", SGLANG_SCRIPTS)
def test_internal_listeners_stay_on_loopback_by_default(script: str, device: str) -> None:
    """sglang's own listeners (KV-transfer sockets, gloo/NCCL, Mooncake TCP, the torch.distributed rendezvous as a
    file store, a fresh path per launch) are pinned to this machine unless HOST opens the server."""
    got = _bind_vars(dry_run(script, device)[1])
    assert got.keys() == BIND_VARS.keys(), got
    assert all(got[k].startswith(v) if k.endswith("OVERRIDE") else got[k] == v for k, v in BIND_VARS.items()), got
    assert (
        got["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"]
        != _bind_vars(dry_run(script, device)[1])["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"]
    )


@pytest.mark.parametrize("host", ["::1", "0:0:0:0:0:0:0:1", "[0::0001]", "127.0.0.2"])
def test_every_loopback_spelling_gets_the_local_only_defaults(host: str) -> None:
    """The IPv6 loopback spelled in full got none of them (only 127.*, localhost and ::1 were matched)."""
    got = _bind_vars(dry_run("launch_decode.sh", "cpu", HOST=host)[1])
    assert got.keys() == BIND_VARS.keys(), got


@pytest.mark.parametrize("script", SGLANG_SCRIPTS)
def test_host_leaves_internal_listeners_stock(script: str) -> None:
    assert _bind_vars(dry_run(script, "cuda", HOST="0.0.0.0")[1]) == {}


def test_user_values_and_dist_init_addr_win() -> None:
    got = _bind_vars(dry_run("launch_prefill.sh", "cpu", SGLANG_HOST_IP="10.1.2.3", GLOO_SOCKET_IFNAME="eth0")[1])
    assert got["SGLANG_HOST_IP"] == "10.1.2.3" and got["GLOO_SOCKET_IFNAME"] == "eth0", got
    assert _bind_vars(dry_run("launch_decode.sh", "cpu", "--dist-init-addr", "10.0.0.1:5000")[1]) == {}


def test_cpu_server_env_keeps_listeners_on_loopback(tmp_path) -> None:
    """CpuServer (one sglang server, no script) gets the same defaults; a caller's value wins."""
    from flashmemory.serve.cpu_server import CpuServer
    from flashmemory.serve.procs import loopback_env

    env = CpuServer(tmp_path / "m", tmp_path / "log", env={"GLOO_SOCKET_IFNAME": "eth9"}).env
    assert env["GLOO_SOCKET_IFNAME"] == "eth9" and env["SGLANG_HOST_IP"] == "127.0.0.1"
    assert env["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"].startswith("file://")
    assert (
        loopback_env({}, "a")["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"]
        != loopback_env({}, "b")["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"]
    )


RENDEZVOUS = """
import json, os, sys, torch.distributed as dist
from tests.docs.listening import listening
dist.init_process_group("gloo", init_method=sys.argv[1], world_size=1, rank=0)
print(json.dumps(sorted({a for addrs in listening({os.getpid()}).values() for a in addrs})))
"""


def test_file_store_rendezvous_opens_no_wide_listener(tmp_path) -> None:
    """Why the scripts swap the rendezvous: torch's TCPStore listens on every interface even when given
    127.0.0.1, while the file store with gloo on `lo` listens on loopback only."""
    from flashmemory.serve.procs import free_ports

    def addrs(method: str, **env: str) -> list[str]:
        p = subprocess.run(
            [sys.executable, "-c", RENDEZVOUS, method],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert set(addrs(f"tcp://127.0.0.1:{free_ports(1)[0]}")) & {"0.0.0.0", "::"}
    assert set(addrs(f"file://{tmp_path / 'store'}", GLOO_SOCKET_IFNAME="lo")) == {"127.0.0.1"}


def test_flashmemory_serve_binds_localhost() -> None:
    from flashmemory.serve.stack import PDConfig, _env

    cfg = PDConfig(base_env={"HOST": "0.0.0.0", "PATH": os.environ.get("PATH", "")})
    assert cfg.host == "127.0.0.1"
    assert _env(cfg)["HOST"] == "127.0.0.1"


def test_listening_reads_the_bound_address_of_each_port() -> None:
    """The /proc reader the live stack check uses tells a loopback bind from an every-interface one."""
    from tests.docs.listening import bound_socket, is_loopback, listening

    local, every = bound_socket("127.0.0.1"), bound_socket("0.0.0.0")
    try:
        ports = listening({os.getpid()})
        assert ports[local.getsockname()[1]] == {"127.0.0.1"}
        assert ports[every.getsockname()[1]] == {"0.0.0.0"}
        assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    finally:
        local.close()
        every.close()


def test_serve_stack_names_a_store_per_server_and_removes_it(tmp_path) -> None:
    """`flashmemory serve` hands each script its own rendezvous store (loopback HOST only) and removes it once the
    server is stopped (a killed server leaves it behind); a store the project did not name is left alone."""
    from flashmemory.serve.procs import RENDEZVOUS_VAR, Servers, remove_rendezvous_store
    from flashmemory.serve.stack import PDConfig, _env

    base = {"PATH": os.environ.get("PATH", "")}
    a, b = (_env(PDConfig(base_env=base))[RENDEZVOUS_VAR] for _ in range(2))
    assert a.startswith("file://") and a != b
    assert RENDEZVOUS_VAR not in _env(PDConfig(base_env=base, host="0.0.0.0"))
    store = Path(a.removeprefix("file://"))
    store.write_bytes(b"")
    with Servers(tmp_path / "logs") as servers:
        servers.start("sleeper", ["sleep", "60"], {**base, RENDEZVOUS_VAR: a})
    assert not store.exists()
    other = tmp_path / "flashmemory-dist-user"
    other.write_bytes(b"")
    assert not remove_rendezvous_store({RENDEZVOUS_VAR: f"file://{other}"}) and other.exists()


def test_stale_stores_of_killed_servers_are_swept(tmp_path) -> None:
    """A store named by a live process's environment stays; one whose server was killed (no process names it)
    goes; a file without the project's prefix is never touched."""
    from flashmemory.serve.procs import RENDEZVOUS_VAR, STORE_PREFIX, remove_stale_rendezvous_stores

    live, dead, other = (tmp_path / n for n in (STORE_PREFIX + "live", STORE_PREFIX + "dead", "unrelated"))
    for f in (live, dead, other):
        f.write_bytes(b"")
    p = subprocess.Popen(["sleep", "60"], env={**os.environ, RENDEZVOUS_VAR: f"file://{live}"})
    try:
        assert remove_stale_rendezvous_stores(tmp_path) == [dead.name]
    finally:
        p.kill()
        p.wait()
    assert live.exists() and not dead.exists() and other.exists()
    assert remove_stale_rendezvous_stores(tmp_path) == [live.name]
