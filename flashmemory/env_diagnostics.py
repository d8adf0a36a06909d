"""The diagnostic and test-only variables: a scheduler's counters file, the HiSparse swap-in trace, and the two
fault injectors (a failing hook, a late Level-1 worker). None of them is a gate: with all unset, serving is the same.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from flashmemory.env_values import EnvError

STATS_FILE = "FLASHMEMORY_STATS_FILE"


def stats_file(env: Mapping[str, str] | None = None) -> str:
    """FLASHMEMORY_STATS_FILE: where a scheduler writes its diagnostic counters as JSON ("" = off). A diagnostic
    for `scripts/gpu_check.py`, not a gate, so it is not part of `FlashMemoryEnv`."""
    return (os.environ if env is None else env).get(STATS_FILE, "")


HISPARSE_TRACE = "FLASHMEMORY_HISPARSE_TRACE"


def hisparse_trace(env: Mapping[str, str] | None = None) -> str:
    """FLASHMEMORY_HISPARSE_TRACE: an absolute file the HiSparse CPU swap-in appends every call's top-k picks to,
    as JSON lines ("" = off), to replay the live hot buffer (`flashmemory.eval.hisparse_trace.replay_trace`).
    A diagnostic, not a gate; a relative path is an EnvError (the server's working directory is not the caller's)."""
    raw = ((os.environ if env is None else env).get(HISPARSE_TRACE) or "").strip()
    if raw and not os.path.isabs(raw):
        raise EnvError(f"{HISPARSE_TRACE}={raw!r}: expected an absolute file path")
    return raw


FAULT_INJECT = "FLASHMEMORY_FAULT_INJECT"


@dataclass(frozen=True)
class FaultSpec:
    """FLASHMEMORY_FAULT_INJECT="hook=<hook name>,rid=<regex>[,rank=<n>]": test only. The guarded FlashMemory hook
    `hook` raises a `RequestFailure` for each request of its batch whose id matches `rid` (`re.search`), before its
    body runs; with `rank`, only on that tensor-parallel rank (a failure the other ranks must learn of)."""

    hook: str
    rid: str
    rank: int | None = None


def fault_inject(env: Mapping[str, str] | None = None, hooks: tuple[str, ...] = ()) -> FaultSpec | None:
    """Parse FLASHMEMORY_FAULT_INJECT (None when unset or empty). `hooks`: the hook names it may name (unchecked when
    empty). A malformed value is an EnvError naming the variable."""
    import re

    raw = ((os.environ if env is None else env).get(FAULT_INJECT) or "").strip()
    if not raw:
        return None
    fields: dict[str, str] = {}
    for part in raw.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("hook", "rid", "rank") or key in fields:
            raise EnvError(
                f"{FAULT_INJECT}={raw!r}: expected 'hook=<hook name>,rid=<regex>[,rank=<n>]' (bad part {part!r})"
            )
        fields[key] = value.strip()
    if not fields.get("hook") or not fields.get("rid"):
        raise EnvError(f"{FAULT_INJECT}={raw!r}: needs both hook=<hook name> and rid=<regex>")
    if hooks and fields["hook"] not in hooks:
        raise EnvError(f"{FAULT_INJECT}={raw!r}: unknown hook {fields['hook']!r} (one of {', '.join(sorted(hooks))})")
    try:
        re.compile(fields["rid"])
    except re.error as e:
        raise EnvError(f"{FAULT_INJECT}={raw!r}: rid is not a regular expression ({e})") from None
    rank = fields.get("rank")
    if rank is not None and not rank.isdigit():
        raise EnvError(f"{FAULT_INJECT}={raw!r}: rank must be a non-negative integer, got {rank!r}")
    return FaultSpec(fields["hook"], fields["rid"], int(rank) if rank is not None else None)


LEVEL1_DELAY = "FLASHMEMORY_LEVEL1_DELAY"


@dataclass(frozen=True)
class DelaySpec:
    """FLASHMEMORY_LEVEL1_DELAY="ms=<milliseconds>[,rank=<n>]": test only. The Level-1 worker sleeps that long after
    scoring each request (on rank `n` only, when given): a worker late by a chosen amount on one rank."""

    seconds: float
    rank: int | None = None


def level1_delay(env: Mapping[str, str] | None = None) -> DelaySpec | None:
    """Parse FLASHMEMORY_LEVEL1_DELAY (None when unset or empty); a malformed value is an EnvError naming it."""
    raw = ((os.environ if env is None else env).get(LEVEL1_DELAY) or "").strip()
    if not raw:
        return None
    fields = dict(part.strip().partition("=")[::2] for part in raw.split(","))
    if (
        set(fields) - {"ms", "rank"}
        or not fields.get("ms", "").isdigit()
        or not fields.get("rank", "0").isdigit()
        or int(fields["ms"]) > 60_000
    ):
        raise EnvError(f"{LEVEL1_DELAY}={raw!r}: expected 'ms=<0..60000>[,rank=<n>]'")
    return DelaySpec(int(fields["ms"]) / 1000, int(fields["rank"]) if "rank" in fields else None)
