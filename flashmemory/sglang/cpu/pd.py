"""PD disaggregation on CPU (SGLANG_FLASHMEMORY_CPU=1): P's KV reaches D for real, through NIXL over host DRAM.

NIXL (`TRANSFER_BACKEND=nixl`, the default; extra `.[serve-nixl]`) imports and moves host-memory bytes over UCX
without CUDA (nixl 1.5.1: `nixl` picks `nixl_cu13` from torch's CUDA build and needs no libcuda). sglang
registers and addresses its KV pools as NIXL memory type "VRAM" (`disaggregation/nixl/conn.py:979`, the
transfers at `:2600`, `:2782`, `:2830`, `:2955`, `:3009`; the decode kinds at `disaggregation/decode.py:629-655`).
On CPU those pools are host memory, and UCX refuses a "VRAM" registration of host memory (`registerMem` ->
NIXL_ERR_BACKEND). Every NIXL call of an agent resolves its memory-type string through one table,
`nixl_agent.nixl_mems` (name -> NIXL enum); `alias_vram_to_dram` points that table's "VRAM" at DRAM, so every
registration, descriptor list and transfer of the agent says DRAM. That is the only seam: no sglang function
changes, and mixed VRAM/DRAM kinds (shrink mode's host-mirror entries, `hooks.before_nixl_manager_init`) become
homogeneous DRAM, which they are.

`patch_nixl_agent_class` wraps the agent class's `__init__` once per process (idempotent); `install` does it
for the class sglang imports (`nixl._api.nixl_agent`) when SGLANG_FLASHMEMORY_CPU=1 and nixl is installed.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from flashmemory.env import cpu_enabled

logger = logging.getLogger(__name__)
_PATCHED_MARK = "_flashmemory_cpu_dram"


def alias_vram_to_dram(agent: Any) -> None:
    """Make `agent` (a `nixl_agent`) treat memory type "VRAM" as "DRAM": on CPU every sglang pool is host memory.

    Mutates the agent's `nixl_mems` table (name -> NIXL memory-type enum); raises if the table or its "DRAM"
    entry is missing (a nixl release whose API this was not written against)."""
    mems = getattr(agent, "nixl_mems", None)
    if not isinstance(mems, dict) or "DRAM" not in mems:
        raise RuntimeError("nixl_agent has no nixl_mems['DRAM'] table: this nixl release is not supported on CPU "
                           "(tested: nixl 1.5.1)")
    mems["VRAM"] = mems["DRAM"]


def patch_nixl_agent_class(cls: type) -> bool:
    """Wrap `cls.__init__` so each new agent aliases VRAM to DRAM. Returns False if it was already wrapped."""
    if getattr(cls.__init__, _PATCHED_MARK, False):
        return False
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        alias_vram_to_dram(self)

    setattr(__init__, _PATCHED_MARK, True)
    cls.__init__ = __init__
    return True


def install() -> str:
    """Patch the NIXL agent sglang uses (`nixl._api.nixl_agent`) when the CPU layer is on. Idempotent.

    Returns what it did, for the startup log: 'off' (gate off), 'no nixl' (not installed: the other backends are
    untouched), 'patched' or 'already patched'."""
    if not cpu_enabled():
        return "off"
    try:
        api = importlib.import_module("nixl._api")
    except ImportError:
        return "no nixl"
    done = patch_nixl_agent_class(api.nixl_agent)
    if done:
        logger.info("FlashMemory CPU: NIXL agents register and move KV as host DRAM (VRAM aliased to DRAM)")
    return "patched" if done else "already patched"
