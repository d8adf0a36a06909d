"""`flashmemory.atomic.publish_dir`: a directory is built once, published whole or not at all, readable by others,
and an existing one is kept only when intact; `file_sha256` hashes a file's bytes."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest

from flashmemory.atomic import file_sha256, publish_dir


class Refused(Exception):
    pass


def _write(tmp: Path) -> None:
    (tmp / "a.txt").write_text("a")
    (tmp / "a.txt").chmod(0o600)  # owner-only, as safetensors writes it


def test_builds_once_and_readable_by_others(tmp_path: Path) -> None:
    out = tmp_path / "build"
    calls = []
    got = publish_dir(out, lambda t: (calls.append(t), _write(t)), lambda d: True, lambda: Refused("no"))
    assert got == out and (out / "a.txt").read_text() == "a" and len(calls) == 1
    assert stat.S_IMODE((out / "a.txt").stat().st_mode) == 0o644 and stat.S_IMODE(out.stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build.lock", "build"]  # no temporary directory left
    # An intact existing build is kept: `write` does not run again.
    assert publish_dir(out, lambda t: calls.append(t), lambda d: True, lambda: Refused("no")) == out
    assert len(calls) == 1


def test_an_existing_directory_that_is_not_intact_is_refused_and_kept(tmp_path: Path) -> None:
    out = tmp_path / "build"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(Refused, match="not intact"):
        publish_dir(out, _write, lambda d: False, lambda: Refused(f"{out.name}: not intact"))
    assert (out / "mine.txt").read_text() == "keep" and not (out / "a.txt").exists()


def test_a_failed_write_publishes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "build"

    def half(t: Path) -> None:
        (t / "half.txt").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_dir(out, half, lambda d: True, lambda: Refused("no"))
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".build.lock"]  # the temporary directory is gone


def test_file_sha256(tmp_path: Path) -> None:
    data = bytes(range(256)) * 5000  # more than one 1 MiB read
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
