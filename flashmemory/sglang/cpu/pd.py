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

Without NIXL, sglang's `fake` backend (`TRANSFER_BACKEND=fake`) runs the PD stack with no transfer at all: D reads
whatever its pools hold (zeros on CPU: torch allocates them zeroed), so its tokens are not P's. It needs three
fixes, installed with the rest (`install`, CPU gate on):
 1. `arg_groups/pd_disaggregation_hook.py:146` asserts a prefill server is not `fake`: `fake_prefill_step`
    wraps that resolution step (sglang's own seam, `register_resolution_hook`) and shows it `nixl` while it runs;
 2. `managers/disagg_service.py:42` builds `get_kv_class(FAKE, BOOTSTRAP_SERVER)`, which is None (fake has none):
    `around_get_kv_class` answers sglang's plain HTTP registry, `CommonKVBootstrapServer`;
 3. `disaggregation/utils.py:238` `_is_fake_transfer` is true only for bootstrap host 2.2.2.2 (warmup), so D
    waits for metadata that a router-sent request never gets: `around_is_fake_transfer` makes every request fake
    when the backend is `fake` (patched in `utils` and where `decode.py:62` imported it).
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable

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


def patch_nixl() -> str:
    """Patch the NIXL agent sglang uses (`nixl._api.nixl_agent`): 'no nixl', 'patched' or 'already patched'."""
    try:
        api = importlib.import_module("nixl._api")
    except ImportError:
        return "no nixl"
    done = patch_nixl_agent_class(api.nixl_agent)
    if done:
        logger.info("FlashMemory CPU: NIXL agents register and move KV as host DRAM (VRAM aliased to DRAM)")
    return "patched" if done else "already patched"


# --- the `fake` backend ---------------------------------------------------------------------------------------

_FAKE = "fake"
_STEP_SOURCE = "flashmemory.sglang.cpu.pd"


def fake_prefill_step(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution-step wrapper for `handle_pd_disaggregation`: a `fake` prefill passes its assert (fix 1)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    cfg = resolving_view(server_args)
    if not (cfg.disaggregation_mode == "prefill" and cfg.disaggregation_transfer_backend == _FAKE):
        previous(server_args)
        return
    declare_resolution(server_args, _STEP_SOURCE, disaggregation_transfer_backend="nixl")
    try:
        previous(server_args)
    finally:
        declare_resolution(server_args, _STEP_SOURCE, disaggregation_transfer_backend=_FAKE)


def around_get_kv_class(original: Callable, transfer_backend: Any, class_type: Any) -> Any:
    """fake's bootstrap server is sglang's plain HTTP registry (fix 2); everything else as shipped."""
    cls = original(transfer_backend, class_type)
    if cls is None and getattr(transfer_backend, "value", transfer_backend) == _FAKE \
            and getattr(class_type, "value", class_type) == "bootstrap_server":
        from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
        return CommonKVBootstrapServer
    return cls


def around_is_fake_transfer(original: Callable, req: Any) -> bool:
    """With the `fake` backend every request is a fake transfer, whatever bootstrap host the router sent (fix 3)."""
    if original(req):
        return True
    from sglang.srt.runtime_context import get_disagg
    return get_disagg().disaggregation_transfer_backend == _FAKE


FAKE_HOOKS: tuple[tuple[str, Callable], ...] = (   # (target, AROUND hook)
    ("sglang.srt.managers.disagg_service.get_kv_class", around_get_kv_class),
    ("sglang.srt.disaggregation.utils._is_fake_transfer", around_is_fake_transfer),
    ("sglang.srt.disaggregation.decode._is_fake_transfer", around_is_fake_transfer),
)


def register_fake_fixes() -> list[str]:
    """Register and apply the three fake fixes; raises RuntimeError naming a target that did not get patched."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from flashmemory.sglang.targets import resolve, unwrap
    register_resolution_hook("handle_pd_disaggregation")(fake_prefill_step)
    originals = {t: resolve(t)[2] for t, _ in FAKE_HOOKS}
    for target, hook in FAKE_HOOKS:
        HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    now = {t: resolve(t)[2] for t, _ in FAKE_HOOKS}
    bad = [t for t in now if now[t] is originals[t] or unwrap(now[t]) is not unwrap(originals[t])]
    if bad:
        raise RuntimeError(f"FlashMemory CPU: PD fake fixes did not apply to {bad} (see 'Failed to apply hooks')")
    return ["handle_pd_disaggregation (resolution step)"] + [t for t, _ in FAKE_HOOKS]


_INSTALLED: dict[str, Any] | None = None


def install() -> dict[str, Any]:
    """The PD part of the CPU layer (CPU gate on), once per process: NIXL as DRAM and the fake fixes.

    Returns {'nixl': what `patch_nixl` did, 'fake': patched targets}; {'nixl': 'off', 'fake': []} with the gate off."""
    global _INSTALLED
    if not cpu_enabled():
        return {"nixl": "off", "fake": []}
    if _INSTALLED is None:
        _INSTALLED = {"nixl": patch_nixl(), "fake": register_fake_fixes()}
    return _INSTALLED
