"""Building the loopback-bind shim: once per source and compiler, atomically, only into a directory of this user's;
one line saying what stays open when it cannot be built (and `flashmemory serve` prints it before starting)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flashmemory.serve import loopback
from flashmemory.serve.loopback import PROBE, SOURCE, STAYS_OPEN, ShimUnavailable, compiler, shim_path

needs_cc = pytest.mark.skipif(compiler() is None, reason="no C compiler on PATH")


@needs_cc
def test_built_once_per_source_and_atomically(tmp_path) -> None:
    """A second call finds the library built; an edited source gets a new name; no temporary is left behind."""
    cache = tmp_path / "cache"
    first = shim_path(cache=cache)  # the cache directory is created, this user's only
    assert (cache.stat().st_mode & 0o777) == 0o700
    mtime = first.stat().st_mtime_ns
    assert shim_path(cache=cache) == first and first.stat().st_mtime_ns == mtime  # cached, not rebuilt
    edited = tmp_path / "edited.c"
    edited.write_bytes(SOURCE.read_bytes() + b"\n/* edited */\n")
    second = shim_path(cache=cache, source=edited)
    assert second != first and second.is_file()
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, second.name])  # no temporaries


@needs_cc
def test_a_compile_error_names_the_source_and_what_stays_open(tmp_path) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("int bind(void) { return\n")
    with pytest.raises(ShimUnavailable) as e:
        shim_path(cache=tmp_path / "cache", source=bad)
    assert str(bad) in str(e.value) and STAYS_OPEN in str(e.value) and "\n" not in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


def _bound_with(lib) -> str:
    """The address a bind to 0.0.0.0 lands on in a child Python with `lib` preloaded (what P and D get)."""
    env = {"LD_PRELOAD": str(lib), "PATH": os.environ.get("PATH", "")}
    p = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    return p.stdout.strip()


@needs_cc
@pytest.mark.parametrize("keep", [100, 0.5])
def test_a_truncated_cached_library_is_rebuilt_not_reused(tmp_path, keep) -> None:
    """A cached library cut short keeps its name; preloaded, the loader skips it with a warning (100 bytes kept:
    Mooncake then binds every interface) or the process dies (half kept). Its bytes no longer hash to its name,
    so it is removed and rebuilt, and what is returned moves binds onto loopback."""
    cache = tmp_path / "cache"
    first = shim_path(cache=cache)
    assert _bound_with(first) == "127.0.0.1"
    data = first.read_bytes()
    first.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    assert _bound_with(first) == ("0.0.0.0" if keep == 100 else "")  # what a reused truncated library gives
    again = shim_path(cache=cache)
    assert _bound_with(again) == "127.0.0.1"
    assert [p.name for p in cache.iterdir()] == [again.name]  # the damaged file is gone, no temporaries


@needs_cc
def test_a_library_that_does_not_move_binds_is_refused(tmp_path) -> None:
    """A source that builds but leaves bind() alone fails the load test: refused in one line, nothing cached."""
    inert = tmp_path / "inert.c"
    inert.write_text("int loopback_bind_inert = 1;\n")
    with pytest.raises(ShimUnavailable, match="does not load or does not move binds") as e:
        shim_path(cache=tmp_path / "cache", source=inert)
    assert STAYS_OPEN in str(e.value) and "\n" not in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


@needs_cc
def test_a_read_only_cache_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    """A cache directory that cannot be written (read-only file system; as root chmod alone would not stop the
    write, so the OS error is injected where the temporary is created) was an OSError traceback: it is the one
    line naming the directory, and `main` exits 1. A verified library already there is still used."""
    import errno
    import tempfile

    cache = tmp_path / "cache"
    built = shim_path(cache=cache)

    def read_only(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system", kw.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(ShimUnavailable, match="cannot write the shim's cache directory"):  # nothing built yet
        shim_path(cache=tmp_path / "empty")
    assert shim_path(cache=cache) == built  # nothing to write: the verified library is used
    built.write_bytes(built.read_bytes()[:100])  # damaged, and no way to rebuild it
    with pytest.raises(ShimUnavailable, match="cannot write the shim's cache directory") as e:
        shim_path(cache=cache)
    assert str(cache) in str(e.value) and STAYS_OPEN in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(loopback, "CACHE", cache)
    monkeypatch.setattr(loopback.shim_path, "__defaults__", (cache, SOURCE))
    assert loopback.main() == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("cannot write the shim's cache directory")


def test_no_compiler_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loopback, "compiler", lambda: None)
    with pytest.raises(ShimUnavailable, match="no C compiler") as e:
        shim_path(cache=tmp_path)
    assert "firewall" in str(e.value) and "\n" not in str(e.value)


@needs_cc
def test_a_cache_others_may_write_is_refused(tmp_path) -> None:
    """A library in the cache runs inside the servers: a group- or world-writable cache is not used."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ShimUnavailable, match="not this user's alone"):
        shim_path(cache=shared)
    assert list(shared.iterdir()) == []


def test_module_prints_the_path_or_the_reason(tmp_path) -> None:
    """`python -m flashmemory.serve.loopback` (what the launch scripts run): the path and exit 0, or the one line
    and exit 1 (here: no compiler on an empty PATH)."""
    env = {**os.environ, "HOME": str(tmp_path)}
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = subprocess.run(
        [sys.executable, "-m", "flashmemory.serve.loopback"],
        env={**env, "PATH": str(empty)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and bad.stdout.startswith("no C compiler") and bad.stdout.count("\n") == 1
    if compiler() is None:
        return
    ok = subprocess.run(
        [sys.executable, "-m", "flashmemory.serve.loopback"], env=env, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().startswith(str(tmp_path / ".cache" / "flashmemory" / "loopback_bind-"))


def test_serve_warns_before_a_mooncake_stack_without_the_shim(monkeypatch, capsys) -> None:
    from flashmemory.serve.stack import PDConfig, hisparse_config, prepare_loopback_shim

    monkeypatch.setattr(loopback, "compiler", lambda: None)
    assert prepare_loopback_shim(PDConfig())  # NIXL: nothing to build
    assert prepare_loopback_shim(hisparse_config(PDConfig(host="0.0.0.0")))  # opened by the user: stock binds
    assert not prepare_loopback_shim(hisparse_config(PDConfig()))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: no C compiler") and "15000-17000" in err[0]
