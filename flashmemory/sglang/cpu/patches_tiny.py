"""A trained tiny model's sliding window where sglang 0.5.23 fixes it: one gated row of the CPU layer.

sglang's DeepSeek-V4 backend attends the last `SWA_WINDOW = 128` tokens, a module constant
(`srt/layers/attention/deepseek_v4_backend.py:161`) that every use reads at call time (the SWA metadata, the
top-k lengths, the prefill tail and the replay tail, `models/deepseek_v4_replay_tail.py:166`, which imports it
inside its function); the config's `window_size` only sizes the SWA pool. DeepSeek-V4 itself uses 128, so the
constant is right for every real checkpoint. The shipped trained tiny model (`flashmemory model pad` makes it
servable) was trained with a window of 32 and does not retrieve at 128 (task score 0 in replay), so
SGLANG_FLASHMEMORY_CPU_SWA_WINDOW=32 (with SGLANG_FLASHMEMORY_CPU=1; `flashmemory.env.cpu_tiny_geometry`) sets
the constant to 32 in that module. Unset, the row is not applied and sglang keeps 128 (stock).

What stays as it is: the `from deepseek_v4_backend import SWA_WINDOW` copy in `deepseek_v4_trtllm_backend.py`
(a CUDA backend, never selected on CPU) and the HIP backend's own constant. The project's CPU ops take every
window-dependent length from sglang's metadata (nothing in `ops/` repeats 128 as a window). sglang's own checks
still run on the new value: the SWA page size must be a multiple of it (`deepseek_v4_backend.py:1274`); the
allowed values (`flashmemory.env`) divide sglang's 256-token page.
"""

from __future__ import annotations

import sys

from flashmemory.sglang.plumbing.patch_spec import Patch
from flashmemory.sglang.plumbing.patching import SWA_FEATURE

_TINY = "flashmemory.sglang.cpu.patches_tiny"
SGLANG_SWA_WINDOW = 128  # the value the row expects to find (deepseek_v4_backend.py:161)


def swa_window(current: int) -> int:
    """Builder of the `attr` row: the window SGLANG_FLASHMEMORY_CPU_SWA_WINDOW names, in place of sglang's
    `current` (refused unless it is the 128 this row was written against)."""
    from flashmemory.env import cpu_tiny_geometry

    if current != SGLANG_SWA_WINDOW:
        raise ValueError(f"found SWA_WINDOW = {current!r}, expected sglang 0.5.23's {SGLANG_SWA_WINDOW}")
    window = cpu_tiny_geometry().swa_window
    if not window:
        raise ValueError("SGLANG_FLASHMEMORY_CPU_SWA_WINDOW is unset: the row should not be active")
    # stderr, the server's log: this runs at plugin load, before sglang configures logging (see plugin.announce)
    print(
        f"FlashMemory CPU layer: sglang's DeepSeek-V4 sliding window SWA_WINDOW {current} -> {window} "
        "(SGLANG_FLASHMEMORY_CPU_SWA_WINDOW)",
        file=sys.stderr,
        flush=True,
    )
    return window


TINY_PATCHES: tuple[Patch, ...] = (
    Patch(
        SWA_FEATURE,
        "sglang.srt.layers.attention.deepseek_v4_backend.SWA_WINDOW",
        "attr",
        f"{_TINY}:swa_window",
        (),
        "deepseek_v4_backend.py:161 SWA_WINDOW = 128 (a module constant; the config's window is not read) -> "
        "SGLANG_FLASHMEMORY_CPU_SWA_WINDOW, for a tiny model trained with a narrower window",
    ),
)
