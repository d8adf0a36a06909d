"""The loopback-bind shim the launch scripts preload for Mooncake, whose transfer engine binds every interface
whatever it is told: unshimmed it listens wide, shimmed it listens on loopback and still moves bytes; the shim
moves only every-interface binds; the scripts preload it on a local stack and say what stays open without a C
compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.doccheck import ROOT
from tests.docs.test_bind import BIND_VARS, dry_run

MOONCAKE = """
import ctypes, json, os, sys, time
try:
    from mooncake.engine import TransferEngine
except ImportError as e:
    print(e)
    sys.exit(3)
from tests.docs.listening import listening
a, b = TransferEngine(), TransferEngine()
assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
n = 1 << 16
src, dst = ctypes.create_string_buffer(os.urandom(n), n), ctypes.create_string_buffer(n)
assert a.register_memory(ctypes.addressof(src), n) == 0 and b.register_memory(ctypes.addressof(dst), n) == 0
rc = a.transfer_sync_write(f"127.0.0.1:{b.get_rpc_port()}", ctypes.addressof(src), ctypes.addressof(dst), n)
print(json.dumps({"rpc": [a.get_rpc_port(), b.get_rpc_port()], "moved": rc == 0 and src.raw == dst.raw,
                  "ports": {p: sorted(x) for p, x in listening({os.getpid()}).items()}}))
"""
MC_LOOPBACK = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "MC_RDMA_BIND_ADDRESS": "127.0.0.1",
    "MC_FORCE_TCP": "1",
    "MC_LEGACY_RPC_PORT_BINDING": "1",
}


def mooncake_probe(**env: str) -> dict:
    """Two Mooncake transfer engines in one process, initialised as sglang does (P2P handshake, TCP, this host's
    address 127.0.0.1), one writing 64 KiB of random bytes into the other: their RPC ports, whether the bytes
    arrived, and every port the process listens on with its bound addresses (a v4-mapped one read as IPv4)."""
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.run(
        [sys.executable, "-c", MOONCAKE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "PYTHONPATH": str(ROOT), **MC_LOOPBACK, **env},
    )
    if p.returncode == 3:
        pytest.skip(f"mooncake.engine does not import: {p.stdout.strip()}")
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    got["ports"] = {int(port): set(addrs) for port, addrs in got["ports"].items()}
    return got


def test_mooncake_listens_on_every_interface_whatever_it_is_told() -> None:
    """Why the launch scripts preload the loopback-bind shim for Mooncake: its transfer engine (the TCP build
    HiSparse's PD uses) binds its RPC/handshake port on 0.0.0.0 and its TCP transport's data port on :: even when
    every setting it reads that names an address says 127.0.0.1 (MC_TCP_BIND_ADDRESS and MC_RDMA_BIND_ADDRESS
    only set the address it advertises; MC_LEGACY_RPC_PORT_BINDING is overridden by the P2P handshake). Two ports
    per engine, both in its RPC range (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, 15000-17000). If this fails because they
    are now on loopback, a setting does it: set that in `fm_local_only` / `loopback_env` and drop the shim."""
    got = mooncake_probe()
    ports = got["ports"]
    assert len(ports) == 4 and set(got["rpc"]) <= ports.keys() and got["moved"], got
    assert all(addrs <= {"0.0.0.0", "::"} and 15000 <= port <= 17000 for port, addrs in ports.items()), got


def test_mooncake_with_the_shim_listens_on_loopback_and_moves_bytes(loopback_shim) -> None:
    """With the shim preloaded, both engines' RPC and TCP data ports are bound on 127.0.0.1 (the data port as
    ::ffff:127.0.0.1 on its dual-stack socket) and a transfer from one engine to the other, which connects to the
    advertised 127.0.0.1, still arrives byte for byte."""
    got = mooncake_probe(LD_PRELOAD=str(loopback_shim))
    ports = got["ports"]
    assert len(ports) == 4 and set(got["rpc"]) <= ports.keys(), got
    assert all(addrs == {"127.0.0.1"} for addrs in ports.values()), got
    assert got["moved"], got


@pytest.fixture(scope="module")
def loopback_shim(tmp_path_factory):
    """The loopback-bind shim built from the package's source into a fresh cache (not the user's)."""
    from flashmemory.serve.loopback import compiler, shim_path

    if compiler() is None:
        pytest.skip(
            "no C compiler: the shim cannot be built "
            "(the scripts then warn; see test_no_compiler_warns_what_stays_open)"
        )
    return shim_path(cache=tmp_path_factory.mktemp("shim_cache"))


SOCKETS = """
import json, socket, sys
def listen(family, address, v6only=None):
    s = socket.socket(family, socket.SOCK_STREAM)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind(address)
    s.listen(4)
    return s
probe = socket.socket(); probe.bind(("127.0.0.1", 0)); fixed = probe.getsockname()[1]; probe.close()
out = {}
for key, family, address, v6only in [
    ("v4_any", socket.AF_INET, ("0.0.0.0", 0), None),
    ("v4_any_fixed_port", socket.AF_INET, ("0.0.0.0", fixed), None),
    ("v6_any_dual", socket.AF_INET6, ("::", 0), 0),
    ("v6_any_v6only", socket.AF_INET6, ("::", 0), 1),
    ("v4_specific", socket.AF_INET, ("127.0.0.2", 0), None),
    ("v6_specific", socket.AF_INET6, ("::1", 0), 1),
]:
    s = listen(family, address, v6only)
    host, port = s.getsockname()[:2]
    out[key] = [host, port == fixed]
    if key == "v6_any_dual":  # an IPv4 client still reaches the dual-stack listener
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn, peer = s.accept()
        out["v4_client_to_dual"] = peer[0]
        conn.close(); c.close()
u = socket.socket(socket.AF_UNIX)
u.bind(sys.argv[1])
out["unix"] = u.getsockname()
print(json.dumps(out))
"""


def _sockets(folder: Path, **env: str) -> dict:
    """What SOCKETS reports, run with `env` (its AF_UNIX socket in `folder`, created here)."""
    folder.mkdir()
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.run(
        [sys.executable, "-c", SOCKETS, str(folder / "unix.sock")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **env},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_shim_moves_only_every_interface_binds_to_loopback(loopback_shim, tmp_path) -> None:
    """0.0.0.0 -> 127.0.0.1 (port kept); :: -> ::ffff:127.0.0.1 on a dual-stack socket (an IPv4 client still
    connects) and ::1 on an IPv6-only one; a specific address and an AF_UNIX path are bound as given. Without the
    shim the same binds are the wildcards (what the shim exists for)."""
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    stock = _sockets(tmp_path / "stock")
    assert stock["v4_any"][0] == "0.0.0.0" and stock["v6_any_dual"][0] == stock["v6_any_v6only"][0] == "::", stock
    got = _sockets(tmp_path / "shim", LD_PRELOAD=str(loopback_shim))
    assert got["v4_any"][0] == "127.0.0.1" and got["v4_any_fixed_port"] == ["127.0.0.1", True], got
    assert got["v6_any_dual"][0] == "::ffff:127.0.0.1" and got["v4_client_to_dual"] == "::ffff:127.0.0.1", got
    assert got["v6_any_v6only"][0] == "::1", got
    assert got["v4_specific"][0] == "127.0.0.2" and got["v6_specific"][0] == "::1", got
    assert got["unix"] == str(tmp_path / "shim" / "unix.sock") and (tmp_path / "shim" / "unix.sock").exists(), got


def has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("script", ["launch_prefill.sh", "launch_decode.sh"])
def test_scripts_preload_the_shim_for_mooncake_on_a_local_stack(script: str, tmp_path) -> None:
    """TRANSFER_BACKEND=mooncake* on a loopback HOST puts the shim (built into the user's cache: HOME here is a
    fresh folder) first in LD_PRELOAD, keeping what the user preloads; NIXL, another HOST or --dist-init-addr
    preload nothing."""
    from flashmemory.serve.loopback import compiler

    if compiler() is None:
        pytest.skip("no C compiler: see test_no_compiler_warns")
    home = {"HOME": str(tmp_path)}
    for backend in ("mooncake", "mooncake_tcp"):
        shim = dry_run(script, "cpu", TRANSFER_BACKEND=backend, **home)[1]["LD_PRELOAD"]
        assert shim.startswith(str(tmp_path / ".cache" / "flashmemory" / "loopback_bind-")) and Path(shim).is_file()
    mine = dry_run(script, "cpu", TRANSFER_BACKEND="mooncake", LD_PRELOAD="libmine.so", **home)[1]["LD_PRELOAD"]
    assert mine == f"{shim} libmine.so"
    assert "LD_PRELOAD" not in dry_run(script, "cpu", TRANSFER_BACKEND="nixl", **home)[1]
    assert "LD_PRELOAD" not in dry_run(script, "cuda", TRANSFER_BACKEND="mooncake", HOST="0.0.0.0", **home)[1]
    if script == "launch_decode.sh":
        args = ("--dist-init-addr", "10.0.0.1:5000")
        assert "LD_PRELOAD" not in dry_run(script, "cpu", *args, TRANSFER_BACKEND="mooncake", **home)[1]


def test_no_compiler_warns_what_stays_open(tmp_path) -> None:
    """Without a C compiler the script still starts, preloads nothing, and warns in one line naming Mooncake's
    ports and how to firewall them."""
    (tmp_path / "empty").mkdir()
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nPATH={tmp_path / "empty"} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("HOST", "DRY_RUN", "LD_PRELOAD", *BIND_VARS)}
    p = subprocess.run(
        ["bash", str(ROOT / "launch_decode.sh")],
        env={**env, "DRY_RUN": "1", "DEVICE": "cpu", "TRANSFER_BACKEND": "mooncake", "PYTHON": str(py)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and "ENV LD_PRELOAD" not in p.stdout, p.stderr
    warn = [ln for ln in p.stderr.splitlines() if "every interface" in ln]
    assert len(warn) == 1 and warn[0].startswith("warning: no C compiler") and "firewall" in warn[0], p.stderr
