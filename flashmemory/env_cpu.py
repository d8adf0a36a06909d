"""The CPU execution layer's variables (`flashmemory.sglang.cpu`): its gate, whether sglang's own thread binding is
set, and the tiny trained model's geometry.

They are read on their own, not through `FlashMemoryEnv`: sglang's platform discovery asks for the gate in every
process, and the CPU layer installs before the plugin reads the rest of the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from flashmemory.env_values import EnvError, read_bool

CPU_GATE = "SGLANG_FLASHMEMORY_CPU"


def cpu_enabled(env: Mapping[str, str] | None = None) -> bool:
    """SGLANG_FLASHMEMORY_CPU: the CPU execution layer for sglang's DeepSeek-V4 path (`flashmemory.sglang.cpu`).

    Read on its own because sglang's platform discovery asks for it in every process, before anything else."""
    return read_bool(os.environ if env is None else env, CPU_GATE, False)


THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"


def cpu_threads_bind_set(env: Mapping[str, str] | None = None) -> bool:
    """sglang's own SGLANG_CPU_OMP_THREADS_BIND (per-rank CPU groups, '|'-separated) is set: the CPU layer then
    leaves sglang's thread binding as it is."""
    return ((os.environ if env is None else env).get(THREADS_BIND) or "all").strip() != "all"


SWA_WINDOW_VAR = "SGLANG_FLASHMEMORY_CPU_SWA_WINDOW"
SGLANG_DSV4_PAGE = 256  # sglang 0.5.23's DeepSeek-V4 page, in tokens (deepseek_v4_backend.py:1258)
SGLANG_SWA_WINDOW = 128  # its sliding window (deepseek_v4_backend.py:161)


@dataclass(frozen=True)
class CpuTinyGeometry:
    """Where a tiny trained model's geometry differs from what sglang 0.5.23 fixes; the CPU layer's rows for it
    (`flashmemory.sglang.cpu.patches_tiny`) take this config.

    swa_window: SGLANG_FLASHMEMORY_CPU_SWA_WINDOW, the sliding window sglang's DeepSeek-V4 backend attends instead
    of its 128 (0 = unset: sglang's own). Needs SGLANG_FLASHMEMORY_CPU=1; a divisor of the 256-token page up to 128
    (the backend asserts the SWA page is a multiple of the window)."""

    swa_window: int = 0


def cpu_tiny_geometry(env: Mapping[str, str] | None = None) -> CpuTinyGeometry:
    """The tiny model's geometry rows' config (read on its own, like `cpu_enabled`: the CPU layer installs before
    `FlashMemoryEnv` is read). A bad value is an EnvError naming the variable."""
    e = os.environ if env is None else env
    raw = (e.get(SWA_WINDOW_VAR) or "").strip()
    if not raw:
        return CpuTinyGeometry()
    try:
        w = int(raw)
    except ValueError:
        raise EnvError(f"{SWA_WINDOW_VAR}={raw!r}: expected a whole number of tokens") from None
    if w < 0 or w > SGLANG_SWA_WINDOW or (w and SGLANG_DSV4_PAGE % w):
        raise EnvError(
            f"{SWA_WINDOW_VAR}={w}: expected a divisor of sglang's {SGLANG_DSV4_PAGE}-token page up to its "
            f"{SGLANG_SWA_WINDOW}-token window (1, 2, 4, ..., 128; 0 = sglang's own)"
        )
    if w and not cpu_enabled(e):
        raise EnvError(f"{SWA_WINDOW_VAR}={w} is a row of the CPU layer: it needs {CPU_GATE}=1")
    return CpuTinyGeometry(w)
