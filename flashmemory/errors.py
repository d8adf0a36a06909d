"""One way for every command to fail on bad input: a `UserError` (or an `OSError`) becomes one line.

Policy (README "Errors and data safety"): an expected failure (a bad file, field, flag or environment
variable; a file-system error such as a missing, unwritable or full path) is printed as
`flashmemory <command>: error: <message naming the file, field or variable>` with a non-zero exit.
`--debug` (anywhere on the command line) re-raises instead, so the traceback shows. Anything else is a
bug and keeps its traceback.

The package's input errors (`EnvError`, `CheckpointError`, `DataConfigError`, ...) subclass `UserError`;
`flashmemory.cli.main` catches it once. A subcommand that prints its own error line calls `fail()`, which
honours `--debug` the same way.
"""

from __future__ import annotations

import errno
import sys

EXIT_USER = 2  # bad input or environment (argparse uses 2 for bad flags, too)
_debug = False  # set once by `flashmemory.cli.main` from --debug


class UserError(ValueError):
    """An expected failure caused by the input or the environment; the message names the file, field or variable."""


def set_debug(on: bool) -> None:
    global _debug
    _debug = bool(on)


def debug() -> bool:
    return _debug


def describe(e: BaseException) -> str:
    """One line for an expected failure: the message, with the path and the cause for an OSError."""
    if isinstance(e, OSError) and e.errno is not None:  # from the OS: the path and the cause
        what = e.strerror or type(e).__name__
        hint = {
            errno.ENOSPC: " (disk full)",
            errno.EACCES: " (not writable or readable by you)",
            errno.EROFS: " (read-only file system)",
            errno.ENOTDIR: " (a path component is a file)",
            errno.EEXIST: " (exists, and is not what was expected)",
        }.get(e.errno or 0, "")
        paths = [p for p in (e.filename, e.filename2) if p]
        where = " -> ".join(map(str, paths)) if paths else "(path not given by the OS)"
        return f"{where}: {what}{hint}"
    msg = str(e).strip() or type(e).__name__
    return " ".join(msg.splitlines())


def fail(command: str, e: BaseException | str, code: int = EXIT_USER) -> int:
    """Print `flashmemory <command>: error: ...` to stderr and return `code`; with --debug, re-raise `e`."""
    if _debug and isinstance(e, BaseException):
        raise e
    text = e if isinstance(e, str) else describe(e)
    print(f"flashmemory {command}: error: {text}", file=sys.stderr)
    return code
