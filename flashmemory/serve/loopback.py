"""The loopback-bind shim (`loopback_bind.c`), built once with the system C compiler and preloaded into servers.

Mooncake's transfer engine binds its RPC/handshake port on 0.0.0.0 and its TCP data port on :: whatever address
it is given; no setting moves them and its compiled library is out of the Patch table's reach. The shim wraps
libc's bind() so that, in a process it is preloaded into (LD_PRELOAD), a bind to 0.0.0.0 lands on 127.0.0.1 and
one to :: on ::ffff:127.0.0.1 (dual-stack socket) or ::1 (IPv6-only); any other bind is untouched. The launch
scripts (`fm_local_only` in scripts/launch_common.sh) preload it into P and D only when the stack is local-only
(a loopback HOST, no --dist-init-addr) and the transfer backend is Mooncake; setting HOST restores stock binds.

Built into `CACHE` (a directory of this user's, never a shared one: a library there runs inside the servers),
named by the SHA-256 of the source and the compile command, so an edited source or another compiler builds a
new file; written to a temporary name and renamed into place, so concurrent first uses (P and D start together)
never load half a library. Standard library only: the scripts run `python -m flashmemory.serve.loopback` with
whatever Python they use, which prints the library's path (exit 0) or one line saying what stays open (exit 1).
Only Linux (glibc or musl with dlsym RTLD_NEXT) is supported; elsewhere the build fails and the line is printed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("loopback_bind.c")
CACHE = Path.home() / ".cache" / "flashmemory"
COMPILERS = ("cc", "gcc", "clang")
FLAGS = ("-shared", "-fPIC", "-O2", "-Wall")
LIBS = ("-ldl",)  # dlsym lives in libdl before glibc 2.34 (an empty stub after)

STAYS_OPEN = (
    "Mooncake's transfer engine will listen on every interface (its RPC/handshake port on 0.0.0.0 and its TCP "
    "data port on ::, both in 15000-17000, MC_MIN_RPC_PORT..MC_MAX_RPC_PORT): firewall that range from other "
    "hosts, or install a C compiler (e.g. apt-get install gcc) so the loopback-bind shim can be built"
)


class ShimUnavailable(RuntimeError):
    """The shim could not be built or placed; the message says why and what stays open."""


def compiler() -> str | None:
    """The first C compiler on PATH (cc, gcc, clang), as an absolute path; None if there is none."""
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def shim_name(source: bytes, cc: str) -> str:
    """loopback_bind-<16 hex of sha256(source, compiler path, flags)>.so: a new name for any change to either."""
    h = hashlib.sha256(source)
    for part in (cc, *FLAGS, *LIBS):
        h.update(b"\0" + part.encode())
    return f"loopback_bind-{h.hexdigest()[:16]}.so"


def _own_dir(d: Path) -> None:
    """Create `d` (0700) and refuse one another user owns or others may write: a library there runs in servers."""
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.stat()
    except OSError as e:
        raise ShimUnavailable(f"cannot create the shim's cache directory {d} ({e.strerror}); {STAYS_OPEN}") from e
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ShimUnavailable(f"the shim's cache directory {d} is not this user's alone; {STAYS_OPEN}")


def shim_path(cache: Path = CACHE, source: Path = SOURCE) -> Path:
    """The built shim (absolute path), compiled now if this source and compiler have not been built yet.

    Raises ShimUnavailable (one line: why, and what stays open) when there is no compiler, the compile fails, or
    the cache directory is unusable."""
    cc = compiler()
    if cc is None:
        raise ShimUnavailable(f"no C compiler ({', '.join(COMPILERS)}) on PATH; {STAYS_OPEN}")
    src = source.read_bytes()
    _own_dir(cache)
    out = cache / shim_name(src, cc)
    if out.is_file() and out.stat().st_uid == os.getuid():
        return out.resolve()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=cache)
    os.close(fd)
    try:
        p = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(source), *LIBS], capture_output=True, text=True, timeout=120, check=False
        )
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise ShimUnavailable(f"{cc} could not build {source} ({last}); {STAYS_OPEN}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    except OSError as e:
        raise ShimUnavailable(f"building {source} into {cache} failed ({e}); {STAYS_OPEN}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out.resolve()


def main() -> int:
    """Print the shim's path (exit 0), or the one line saying why there is none and what stays open (exit 1)."""
    try:
        print(shim_path())
    except ShimUnavailable as e:
        print(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
