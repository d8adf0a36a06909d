"""Checks every benchmark runs before it does any work: numbers that parse, sizes that fit this machine.

- `guard_numbers(parser)`: every `type=int` / `type=float` option of a bench parser is parsed by a checked type
  instead: an int must be a whole number of at most `MAX_INT` in magnitude, a float finite. Every int option of a
  bench is a count or a size, so it must also be >= 1, or >= 0 when its default is 0 (0 then means "the
  default for this run", e.g. `--reps 0`, or it is a seed). argparse then turns a bad value into its own one line
  (`flashmemory bench NAME: error: argument --flag: ...`, exit 2), before `run`.
- `int_list(text, flag, lo, hi)`: a comma-separated list of whole numbers in [lo, hi] (one line naming the flag).
- `require_memory(need, what)`: host memory a bench is about to allocate, against what the OS says is available
  (MemAvailable); a UserError naming the flags that size it when it does not fit.
- `require_disk(path, need, what)`: the same for free space on the filesystem holding `path`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from flashmemory.errors import UserError

MAX_INT = 1 << 40  # larger than any size a bench takes; a value past it is a typo (or an overflow to come)


def checked_int(text: str) -> int:
    """argparse type: a whole number of magnitude <= MAX_INT ('1_000' is fine, '1e6' and '2.5' are not)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if abs(v) > MAX_INT:
        raise argparse.ArgumentTypeError(f"{text}: too large (at most {MAX_INT:,})")
    return v


def checked_float(text: str) -> float:
    """argparse type: a finite number."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def count_at_least(lo: int) -> Callable[[str], int]:
    """argparse type: `checked_int`, and >= `lo`."""

    def count(text: str) -> int:
        v = checked_int(text)
        if v < lo:
            raise argparse.ArgumentTypeError(f"{text}: must be >= {lo}")
        return v

    count.__name__ = f"count_at_least_{lo}"  # argparse names the type in some messages
    return count


def guard_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Swap every plain int / float option type of `parser` for its checked twin (in place); returns parser.
    An int option becomes a count: >= 0 when its default is 0, else >= 1 (`count_at_least`)."""
    for action in parser._actions:  # argparse offers no public walk over a parser's options
        if action.type is int:
            action.type = count_at_least(0 if action.default == 0 else 1)
        elif action.type is float:
            action.type = checked_float
    return parser


def int_list(text: str, flag: str, lo: int = 1, hi: int = MAX_INT) -> list[int]:
    """'2048,4096' -> [2048, 4096]; UserError naming `flag` for anything that is not whole numbers in [lo, hi]."""
    parts = [x.strip() for x in str(text).split(",")]
    if not parts or any(not x for x in parts):
        raise UserError(f"{flag} {text!r}: expected comma-separated whole numbers, e.g. 2048,4096")
    out = []
    for x in parts:
        try:
            out.append(int(x))
        except ValueError:
            raise UserError(f"{flag} {text!r}: {x!r} is not a whole number") from None
    bad = [v for v in out if not lo <= v <= hi]
    if bad:
        raise UserError(f"{flag} {text!r}: {bad[0]} is outside [{lo:,}, {hi:,}]")
    return out


def available_memory() -> int:
    """Bytes of host memory the OS can give now without swapping (Linux MemAvailable; else physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def require_memory(need: int, what: str, avail: int | None = None) -> None:
    """UserError when `need` bytes of host memory exceed 90% of what is available; `what` names the flags."""
    have = available_memory() if avail is None else avail
    if need > 0.9 * have:
        raise UserError(
            f"{what}: needs about {need / 1e9:.3g} GB of host memory, {have / 1e9:.3g} GB is available; lower them"
        )


def require_disk(path: str, need: int, what: str) -> None:
    """UserError when `need` bytes will not fit in the free space of the filesystem holding `path`."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise UserError(f"{what} {path}: needs about {need / 1e9:.3g} GB of disk, {free / 1e9:.3g} GB is free there")
