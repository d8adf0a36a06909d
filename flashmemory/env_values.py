"""How one FlashMemory environment value is read: the error a bad value raises, the typed readers (boolean,
bounded integer, bounded number, c4-layer list) and the bounds that tell a typo from a setting.

Every reader names the variable and the value in its error, so a bad launch fails with one line that says what to
change. The configs built from these readers are in `flashmemory.env` (the gates and knobs), `flashmemory.env_disk`,
`flashmemory.env_cpu` and `flashmemory.env_diagnostics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from flashmemory.errors import UserError


class EnvError(UserError):
    """A FlashMemory environment variable holds a value that cannot be used."""


def read_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    """`name` as a boolean: 1/true/yes/on or 0/false/no/off (any case); unset or blank: `default`."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}={raw!r}: expected 0/1 (or true/false)")


INT_MAX = 2**31 - 1  # counts end up in int32 tensors; anything larger is a typo, not a setting


def read_int(env: Mapping[str, str], name: str, default: int, lo: int = 0, hi: int = INT_MAX) -> int:
    """`name` as an integer in [lo, hi]; unset or blank: `default`."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected an integer") from None
    if v < lo:
        raise EnvError(f"{name}={v}: must be >= {lo}")
    if v > hi:
        raise EnvError(f"{name}={v}: must be <= {hi} (a larger value cannot be meant; is it a typo?)")
    return v


def read_float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    """`name` as a number in [lo, hi]; unset or blank: `default`."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = float(raw.strip())
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected a number") from None
    if not (lo <= v <= hi) or math.isnan(v):
        raise EnvError(f"{name}={v}: must lie in [{lo}, {hi}]")
    return v


def parse_layers(raw: str, name: str = "SGLANG_RETRIEVER_INLINE_LAYERS", n_c4_layers: int = 21) -> tuple[int, ...]:
    """Parse '10,12,20' into sorted unique c4-layer ids, each in [0, n_c4_layers)."""
    try:
        ids = sorted({int(p) for p in raw.replace(" ", "").split(",") if p != ""})
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected comma-separated c4 layer ids like 10,12,20") from None
    if not ids:
        raise EnvError(f"{name}={raw!r}: names no layer")
    bad = [i for i in ids if not 0 <= i < n_c4_layers]
    if bad:
        raise EnvError(
            f"{name}={raw!r}: layer ids {bad} outside [0, {n_c4_layers}) (ids count c4 layers, not model layers)"
        )
    return tuple(ids)


# Upper bounds of the sizing knobs: far above any real server, low enough that a typo (1e12) is named here
# instead of surfacing as an overflow or a failed allocation. Memory itself is checked before allocation
# (`flashmemory.sglang.decode.geometry.check_reserve_memory`).
MAX_POSITION = 1 << 30  # tokens per request (DeepSeek-V4 serves 1,048,576)
MAX_PAGES = MAX_POSITION // (4 * 64)  # c4 pages (64 chunks of 4 tokens) of a MAX_POSITION request
MAX_ROWS = 1 << 16  # concurrent requests
MAX_BLOCKS = 1 << 24  # reserve page blocks per layer
