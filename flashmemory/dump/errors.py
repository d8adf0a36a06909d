"""The dump package's error types (a leaf module: everything else in `flashmemory.dump` may import it)."""

from __future__ import annotations

from flashmemory.errors import UserError


class DumpFormatError(UserError):
    """A dump file or metadata line is missing, truncated, malformed, or inconsistent."""


class DumpOutputError(OSError):
    """The output directory cannot be used: it is a file, not writable, locked by another writer, or full.

    The message is one line naming the directory (and the lock holder's pid when it is locked).
    """
