"""Every server the project starts binds 127.0.0.1 unless the user passes a host: the launch scripts (their
DRY_RUN command, GPU and CPU defaults), the dump server, and `flashmemory serve` (the environment it hands the
scripts). An inherited HOST does not leak into `flashmemory serve`; an explicit HOST opens a script."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from tests.docs.doccheck import ROOT

SCRIPTS = ["launch_prefill.sh", "launch_decode.sh", "launch_router.sh", "data_generation/start_dump_server.sh"]
HOST_FLAGS = ("--host", "--prometheus-host")


def bound_hosts(script: str, device: str, **env: str) -> dict[str, str]:
    """The host flags of the script's DRY_RUN command ({flag: address})."""
    base = {k: v for k, v in os.environ.items() if k not in ("HOST", "DEVICE", "DRY_RUN")}
    extra = {"DUMP_ROOT": "/tmp"} if "dump" in script else {}
    p = subprocess.run(["bash", str(ROOT / script)], env={**base, **extra, "DRY_RUN": "1", "DEVICE": device, **env},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    cmd = shlex.split(next(ln for ln in p.stdout.splitlines() if ln.startswith("CMD "))[4:])
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
