"""Dump-server writes confined to the operator's root, checked at admission and again at the write.

`under_root` (protocol.py) compares real paths once, at admission. That is not enough: a `pass1` /
`pass2` subdirectory that is a symlink to outside, or a directory swapped for a symlink between admission
and the end of the request, would be followed by a plain `open(path)`. So the server never writes by path:

  - the root is opened once (`os.open(realpath(root), O_DIRECTORY)`) and that descriptor is held for the
    recorder's life; every directory below it is opened component by component relative to its parent's
    descriptor with O_NOFOLLOW | O_DIRECTORY, so a symlink (or a file) anywhere below the root is refused;
  - admission (`DocTargets.admit`) walks `output_dir/pass{N}` this way (creating missing directories),
    checks that the document's file name and its temp name fit NAME_MAX, that the name is not taken by a
    directory or a symlink, and that the directory takes a file (a probe is created and removed); it records
    the directory's identity (st_dev, st_ino). A request that fails any of this is refused with the reason;
  - the write (`DocTargets.open_dir`) walks again from the held root descriptor, refuses a directory whose
    identity changed since admission (replaced, moved, or swapped for a symlink), and writes through
    `write_file_at`: a temp file created with O_CREAT | O_EXCL | O_NOFOLLOW relative to the directory's
    descriptor, fsynced, then renamed onto the target name within that same directory.

Nothing here follows a symlink below the root. (The root itself is the operator's: its real path is taken
once, when the first request is admitted.)
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from flashmemory.dump.outdir import tmp_name
from flashmemory.dump.protocol import PARAM_KEY, DumpProtocolError, DumpRequest

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_TRACKED = 100_000  # admitted-but-never-finished requests whose identity is remembered (oldest dropped)


class ConfineError(OSError):
    """A path below the dump root cannot be used: a symlink, a file where a directory should be, a name too
    long, or a directory that changed since admission. The message names the path and the reason."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def unusable(path: str | os.PathLike, below: str | os.PathLike) -> str | None:
    """Why a document cannot be written at `path` (one line naming the component), or None when nothing is wrong
    that can be seen from outside: a symlink at or below `below` (the server never follows one there), a file
    where a folder should be, a name too long for its filesystem, or the document's own name taken by a folder.
    The dump client asks this while it waits for the server's file, so such a directory fails the item at once,
    in one line, instead of after a timeout."""
    p = os.path.abspath(os.fspath(path))
    top = os.path.abspath(os.fspath(below)).rstrip("/") + "/"
    parts = p.strip("/").split("/")
    cur = "/"
    for i, name in enumerate(parts):
        nxt = os.path.join(cur, name)
        try:
            limit = os.pathconf(cur, "PC_NAME_MAX")
        except OSError:
            limit = 255
        if len(os.fsencode(name)) > limit:
            return f"{nxt}: name too long for the filesystem ({len(os.fsencode(name))} bytes, at most {limit})"
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return None  # not there yet: the server creates it
        except OSError as e:
            return f"{nxt}: {e.strerror or e}"
        if stat.S_ISLNK(st.st_mode) and (nxt + "/").startswith(top):
            return f"{nxt}: is a symlink (dump writes never follow symlinks below the dump root)"
        if i == len(parts) - 1:
            return f"{nxt}: is a folder where the document file should be" if stat.S_ISDIR(st.st_mode) else None
        if not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            return f"{nxt}: is a file where a folder should be"
        cur = nxt
    return None


def relative_parts(target: str, root: str) -> list[str]:
    """The components of absolute `target` below `root` (lexically: the root as given or its real path).
    ConfineError when `target` is not below the root. No '.', '..' or empty component is returned."""
    norm = os.path.normpath(target)
    for base in dict.fromkeys((os.path.normpath(os.path.abspath(root)), os.path.realpath(root))):
        if norm == base:
            return []
        prefix = base.rstrip("/") + "/"
        if norm.startswith(prefix):
            parts = norm[len(prefix) :].split("/")
            if any(p in ("", ".", "..") for p in parts):
                raise ConfineError(errno.EINVAL, f"{target}: not a plain path below the dump root {root}")
            return parts
    raise ConfineError(errno.EXDEV, f"{target}: outside the dump root {root}")


def _why(parent_fd: int, name: str, shown: str, e: OSError) -> ConfineError:
    """Name what is wrong with `name` below `parent_fd` (lstat, so a symlink is called a symlink)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        why = "is a symlink (dump writes never follow symlinks below the root)"
    elif st is not None and not stat.S_ISDIR(st.st_mode):
        why = "is a file where a directory should be"
    else:
        why = e.strerror or str(e)
    return ConfineError(e.errno or errno.EINVAL, f"{shown}: {why}")


def open_below(root_fd: int, root: str, parts: list[str], create: bool) -> int:
    """A descriptor of root/parts[0]/.../parts[-1], every component opened relative to its parent with
    O_NOFOLLOW | O_DIRECTORY (created 0o755 when missing and `create`). The caller closes it."""
    fd = os.dup(root_fd)
    shown = root
    try:
        for name in parts:
            shown = os.path.join(shown, name)
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise ConfineError(errno.ENOENT, f"{shown}: no such directory") from None
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # made by someone else meanwhile: opened (and checked) below
                except OSError as e:
                    raise ConfineError(e.errno or errno.EIO, f"{shown}: cannot create ({e.strerror or e})") from None
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise _why(fd, name, shown, e) from None
            except OSError as e:
                raise _why(fd, name, shown, e) from None
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_file_at(dir_fd: int, name: str, data: bytes | memoryview, shown: str) -> None:
    """Atomically write `data` as `name` in the directory `dir_fd`: an exclusive, no-follow temp file
    (`outdir.tmp_name`), fsync, rename onto `name` in the same directory, fsync the directory. On failure
    the temp file is removed and the OSError names `shown` (the path for messages)."""
    tmp = tmp_name(name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise OSError(e.errno, e.strerror or str(e), shown) from None
    try:
        os.fsync(dir_fd)
    except OSError:
        pass


class DocTargets:
    """Where a dump server may write: checks each admitted request's target and confines its write.

    root: the operator's dump root (SGLANG_FLASHMEMORY_DUMP_ROOT); None refuses every request (as
    `under_root` does). State: the held root descriptor and, per admitted rid, its directory's identity."""

    def __init__(self, root: str | os.PathLike | None):
        self.root = None if root is None or str(root) == "" else str(root)
        self._root_fd: int | None = None
        self._ident: dict[str, tuple[int, int]] = {}

    def _root(self) -> int:
        if self._root_fd is None:
            if self.root is None:
                raise DumpProtocolError(
                    f"{PARAM_KEY}.output_dir: this server has no dump root "
                    "(SGLANG_FLASHMEMORY_DUMP_ROOT), so it writes no dump"
                )
            try:
                self._root_fd = os.open(os.path.realpath(self.root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                raise DumpProtocolError(
                    f"the dump root {self.root} (SGLANG_FLASHMEMORY_DUMP_ROOT) cannot be "
                    f"opened as a directory ({e.strerror or e})"
                ) from None
        return self._root_fd

    def _parts(self, req: DumpRequest) -> list[str]:
        return relative_parts(req.output_dir, self.root or "/") + [f"pass{req.pass_}"]

    def admit(self, rid: str, req: DumpRequest) -> None:
        """Check that `req`'s document can be written where it asks (see the module doc); remember the
        directory. DumpProtocolError naming the request, the field and the reason otherwise."""
        name, path = req.doc_path().name, req.doc_path()
        try:
            fd = open_below(self._root(), self.root or "/", self._parts(req), create=True)
        except OSError as e:  # a ConfineError, or the OS (out of descriptors): the request fails, not the server
            raise DumpProtocolError(
                f"request {rid}: {PARAM_KEY}.output_dir={req.output_dir!r}: {e.strerror or e}"
            ) from None
        try:
            self._check_name(fd, name, str(path))
            st = os.fstat(fd)
        except OSError as e:
            shown = str(req.doc_index) if req.doc_index < 10**20 else f"{str(req.doc_index)[:20]}..."
            raise DumpProtocolError(f"request {rid}: {PARAM_KEY}.doc_index={shown}: {e.strerror or e}") from None
        finally:
            os.close(fd)
        if len(self._ident) >= _MAX_TRACKED:
            self._ident.pop(next(iter(self._ident)))
        self._ident[rid] = (st.st_dev, st.st_ino)

    @staticmethod
    def _check_name(fd: int, name: str, shown: str) -> None:
        """`name` (and its temp name) can be created in directory `fd`; ConfineError saying why not."""
        try:
            limit = os.fpathconf(fd, "PC_NAME_MAX")
        except (OSError, ValueError):
            limit = 255
        longest = max(len(os.fsencode(name)), len(os.fsencode(tmp_name(name))))
        if longest > limit:
            raise ConfineError(
                errno.ENAMETOOLONG,
                f"{shown}: file name too long ({longest} bytes with its temp name; this file system allows {limit})",
            )
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise ConfineError(e.errno or errno.EIO, f"{shown}: {e.strerror or e}") from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            kind = (
                "a symlink"
                if stat.S_ISLNK(st.st_mode)
                else "a directory"
                if stat.S_ISDIR(st.st_mode)
                else "not a regular file"
            )
            raise ConfineError(errno.EEXIST, f"{shown}: exists and is {kind}, so the document cannot be written")
        probe = tmp_name("probe")
        try:
            os.close(
                os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
            )
            os.unlink(probe, dir_fd=fd)
        except OSError as e:
            raise ConfineError(
                e.errno or errno.EIO,
                f"{os.path.dirname(shown)}: the directory does not take a file ({e.strerror or e})",
            ) from None

    @contextmanager
    def open_dir(self, rid: str, req: DumpRequest) -> Iterator[int]:
        """A descriptor of `req`'s directory for the write, walked again from the held root (no symlink
        followed) and, when `rid` was admitted here, the same directory as at admission; else ConfineError."""
        path = req.doc_path().parent
        fd = open_below(self._root(), self.root or "/", self._parts(req), create=True)
        try:
            want = self._ident.pop(rid, None)
            st = os.fstat(fd)
            if want is not None and (st.st_dev, st.st_ino) != want:
                raise ConfineError(
                    errno.ESTALE,
                    f"{path}: not the directory admitted for request {rid} (it was "
                    "replaced or moved since); document not written",
                )
            yield fd
        finally:
            os.close(fd)

    def forget(self, rid: str) -> None:
        """Drop what admission remembered for `rid` (its request ended without a document)."""
        self._ident.pop(rid, None)

    def close(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def __del__(self) -> None:
        self.close()


__all__ = ["ConfineError", "DocTargets", "open_below", "relative_parts", "write_file_at"]
