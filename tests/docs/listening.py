"""Listening TCP sockets of a set of processes, read from /proc (Linux): a test helper for bind-address checks.

`listening(pids)` maps each listening port to the addresses it is bound on, e.g. {31503: {"127.0.0.1"}}; an
address of "0.0.0.0" or "::" means every interface. Sockets are matched to processes by inode
(/proc/<pid>/fd -> socket:[inode]); processes that vanish or cannot be read are skipped.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

LISTEN = "0A"  # TCP state code in /proc/net/tcp


def _inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(target[8:-1])
    except OSError:
        pass
    return out


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} local address (little-endian 32-bit words) -> dotted or colon text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i : i + 4])[0]) for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return str(addr.ipv4_mapped)
    return str(addr)


def listening(pids: set[int]) -> dict[int, set[str]]:
    """{port: {bound address, ...}} of the TCP sockets the processes `pids` listen on."""
    inodes = set().union(*(_inodes(p) for p in pids)) if pids else set()
    ports: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != LISTEN or f[9] not in inodes:
                continue
            addr, port = f[1].rsplit(":", 1)
            ports.setdefault(int(port, 16), set()).add(_address(addr))
    return ports


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def bound_socket(host: str) -> socket.socket:
    """A socket listening on (host, any free port): for the helper's own test."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.bind((host, 0))
    s.listen(1)
    return s
