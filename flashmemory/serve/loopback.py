"""The loopback-bind shim (`loopback_bind.c`), built once with the system C compiler and preloaded into servers.

Mooncake's transfer engine binds its RPC/handshake port on 0.0.0.0 and its TCP data port on :: whatever address
it is given; no setting moves them and its compiled library is out of the Patch table's reach. The shim wraps
libc's bind() so that, in a process it is preloaded into (LD_PRELOAD), a bind to 0.0.0.0 lands on 127.0.0.1 and
one to :: on ::ffff:127.0.0.1 (dual-stack socket) or ::1 (IPv6-only); any other bind is untouched. The launch
scripts (`fm_local_only` in scripts/launch_common.sh) preload it into P and D only when the stack is local-only
(a loopback HOST, no --dist-init-addr) and the transfer backend is Mooncake; setting HOST restores stock binds.

Built into `CACHE` (a directory of this user's, never a shared one: a library there runs inside the servers),
named by the SHA-256 of the source and the compile command (an edited source or another compiler builds a new
file) and of the library's own bytes; written to a temporary name, load-tested and renamed into place, so
concurrent first uses (P and D start together) never load half a library. A cached library is used only when
its bytes still hash to its name and it passes the load test (preloaded into a child Python, a bind to 0.0.0.0
lands on 127.0.0.1): a truncated or damaged one (which the loader would skip with a warning, leaving Mooncake
on every interface) is removed and rebuilt, or refused in one line when the cache cannot be written.
Standard library only: the scripts run `python -m flashmemory.serve.loopback` with
whatever Python they use, which prints the library's path (exit 0) or one line saying what stays open (exit 1).
Only Linux (glibc or musl with dlsym RTLD_NEXT) is supported; elsewhere the build fails and the line is printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
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
    """loopback_bind-<16 hex of sha256(source, compiler path, flags)>: a new stem for any change to either; the
    library is `<stem>-<16 hex of sha256(its bytes)>.so` (`library_name`)."""
    h = hashlib.sha256(source)
    for part in (cc, *FLAGS, *LIBS):
        h.update(b"\0" + part.encode())
    return f"loopback_bind-{h.hexdigest()[:16]}"


def library_name(stem: str, lib: Path) -> str:
    """`<stem>-<16 hex of sha256(lib's bytes)>.so`: a cached library whose bytes changed no longer matches it."""
    return f"{stem}-{hashlib.sha256(lib.read_bytes()).hexdigest()[:16]}.so"


# Run in a child Python with the library preloaded: a bind to 0.0.0.0 must come back bound to 127.0.0.1.
PROBE = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[0]); s.close()"


def load_test(lib: Path) -> str:
    """'' if `lib`, preloaded (LD_PRELOAD) into a child Python, moves its bind to 0.0.0.0 onto 127.0.0.1; else
    why not (the loader skipped it, it crashed the child, or the bind stayed on every interface), in one line."""
    env = {"LD_PRELOAD": str(lib), "PATH": os.environ.get("PATH", "")}
    try:
        p = subprocess.run(
            [sys.executable, "-I", "-S", "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the load test could not run ({type(e).__name__}: {e})"
    got = p.stdout.strip()
    if p.returncode == 0 and got == "127.0.0.1" and "preloaded" not in p.stderr:
        return ""
    why = (p.stderr.strip().splitlines() or [f"exit {p.returncode}, bound {got or 'nothing'}"])[0]
    return f"it does not load or does not move binds ({why})"


def _cached(cache: Path, stem: str) -> Path | None:
    """A verified library of `stem` in `cache` (this user's regular file, bytes hashing to its name, load test
    passed), or None; damaged ones of this stem are removed (best effort: the cache may be read-only)."""
    for lib in sorted(cache.glob(f"{stem}-*.so")):
        try:
            st = lib.lstat()
            ok = stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and library_name(stem, lib) == lib.name
        except OSError:
            ok = False
        if ok and not load_test(lib):
            return lib.resolve()
        with contextlib.suppress(OSError):
            lib.unlink()
    return None


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

    Raises ShimUnavailable (one line: why, and what stays open) when there is no compiler, the compile fails, the
    built library fails the load test, or the cache directory is unusable (not this user's, or not writable when
    there is no verified library in it)."""
    cc = compiler()
    if cc is None:
        raise ShimUnavailable(f"no C compiler ({', '.join(COMPILERS)}) on PATH; {STAYS_OPEN}")
    src = source.read_bytes()
    _own_dir(cache)
    stem = shim_name(src, cc)
    found = _cached(cache, stem)
    if found is not None:
        return found
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=cache)
    except OSError as e:  # a read-only or full cache directory: one line, not a traceback
        raise ShimUnavailable(
            f"cannot write the shim's cache directory {cache} ({e.strerror or e}) and it holds no usable build of "
            f"{source.name}; {STAYS_OPEN}"
        ) from e
    os.close(fd)
    try:
        p = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(source), *LIBS], capture_output=True, text=True, timeout=120, check=False
        )
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise ShimUnavailable(f"{cc} could not build {source} ({last}); {STAYS_OPEN}")
        os.chmod(tmp, 0o755)
        why = load_test(Path(tmp))
        if why:
            raise ShimUnavailable(f"{cc} built {source}, but {why}; {STAYS_OPEN}")
        out = cache / library_name(stem, Path(tmp))
        os.replace(tmp, out)
    except (OSError, subprocess.TimeoutExpired) as e:
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
