"""PD disaggregation on CPU (SGLANG_FLASHMEMORY_CPU=1): P's KV reaches D for real, through NIXL over host DRAM.

NIXL (`TRANSFER_BACKEND=nixl`, the default; extra `.[serve-nixl]`) imports and moves host-memory bytes over UCX
without CUDA (nixl 1.5.1: `nixl` picks `nixl_cu13` from torch's CUDA build and needs no libcuda). sglang
registers and addresses its KV pools as NIXL memory type "VRAM" (`disaggregation/nixl/conn.py:979`, the
transfers at `:2600`, `:2782`, `:2830`, `:2955`, `:3009`; the decode kinds at `disaggregation/decode.py:629-655`).
On CPU those pools are host memory, and UCX refuses a "VRAM" registration of host memory (`registerMem` ->
NIXL_ERR_BACKEND). Every NIXL call of an agent resolves its memory-type string through one table,
`nixl_agent.nixl_mems` (name -> NIXL enum); `alias_vram_to_dram` points that table's "VRAM" at DRAM, so every
registration, descriptor list and transfer of the agent says DRAM. That is the only seam: no sglang function
changes, and mixed VRAM/DRAM kinds (shrink mode's host-mirror entries, `shrink_hooks.before_nixl_manager_init`) become
homogeneous DRAM, which they are.

`around_nixl_agent_init` wraps every `nixl._api.nixl_agent.__init__` (a row of `PD_PATCHES`, applied with every
other patch when SGLANG_FLASHMEMORY_CPU=1; skipped when nixl is not installed).

UCX's progress thread spins. nixl's Python API builds every agent with `pthrDelay = 0` (nixl_cu13/_api.py:226),
so each agent's progress thread polls without pause: a whole core per NIXL process on an idle box (two agents idle
for 4 s here: 0.51 CPU-s with delay 0, 0.16 with 1,000 us: two separate runs on a loaded box, a sign).
On 2 cores a PD stack's P and D spent the
CPU their forwards needed on that spin. An `attr` row of `PD_PATCHES` points `nixl._api.nixlBind` (the
bindings `__init__` reads) at `_DelayedBindings`, whose agent config never takes a progress delay below
PROGRESS_DELAY_US: the thread then waits up to 1 ms between polls when idle,
and transfers still complete at once (the same script: 1-12 ms per 112-KB transfer, every byte equal).

Without NIXL, sglang's `fake` backend (`TRANSFER_BACKEND=fake`) runs the PD stack with no transfer at all: D reads
whatever its pools hold (zeros on CPU: torch allocates them zeroed), so its tokens are not P's. It needs three
fixes, rows of `PD_PATCHES` too:
 1. `arg_groups/pd_disaggregation_hook.py:146` asserts a prefill server is not `fake`: `fake_prefill_step`
    wraps that resolution step (sglang's own seam, `register_resolution_hook`) and shows it `nixl` while it runs;
 2. `managers/disagg_service.py:42` builds `get_kv_class(FAKE, BOOTSTRAP_SERVER)`, which is None (fake has none):
    `around_get_kv_class` answers sglang's plain HTTP registry, `CommonKVBootstrapServer`;
 3. `disaggregation/utils.py:238` `_is_fake_transfer` is true only for bootstrap host 2.2.2.2 (warmup), so D
    waits for metadata that a router-sent request never gets: `around_is_fake_transfer` makes every request fake
    when the backend is `fake` (patched in `utils` and where `decode.py:62` imported it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashmemory.sglang.plumbing.patch_spec import Patch


def alias_vram_to_dram(agent: Any) -> None:
    """Make `agent` (a `nixl_agent`) treat memory type "VRAM" as "DRAM": on CPU every sglang pool is host memory.

    Mutates the agent's `nixl_mems` table (name -> NIXL memory-type enum); raises if the table or its "DRAM"
    entry is missing (a nixl release whose API this was not written against)."""
    mems = getattr(agent, "nixl_mems", None)
    if not isinstance(mems, dict) or "DRAM" not in mems:
        raise RuntimeError(
            "nixl_agent has no nixl_mems['DRAM'] table: this nixl release is not supported on CPU (tested: nixl 1.5.1)"
        )
    mems["VRAM"] = mems["DRAM"]


PROGRESS_DELAY_US = 1000  # the least UCX progress-thread delay on CPU (nixl's default, 0, is a busy loop)


class _DelayedBindings:
    """nixl's bindings module as `nixl_agent.__init__` sees it, except `nixlAgentConfig`: a subclass whose
    `pthrDelay` (microseconds) never goes below `delay_us`. Everything else is the shipped module's."""

    def __init__(self, bindings: Any, delay_us: int):
        prop = getattr(bindings.nixlAgentConfig, "__dict__", {}).get("pthrDelay")
        if not isinstance(prop, property) or prop.fset is None:
            raise RuntimeError(
                "nixl's nixlAgentConfig has no settable pthrDelay: this nixl release is not supported "
                "on CPU (tested: nixl 1.5.1)"
            )
        self._bindings, self.delay_us = bindings, delay_us
        self.nixlAgentConfig = type(
            "nixlAgentConfig",
            (bindings.nixlAgentConfig,),
            {"pthrDelay": property(prop.fget, lambda cfg, us: prop.fset(cfg, max(int(us), delay_us)))},
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)


def delayed_bindings(bindings: Any) -> _DelayedBindings:
    """Builder of the `attr` row on `nixl._api.nixlBind` (the bindings `nixl_agent.__init__` reads; nixl
    re-exports nixl_cu13._api): the shipped bindings behind `_DelayedBindings`, never wrapped twice."""
    return bindings if isinstance(bindings, _DelayedBindings) else _DelayedBindings(bindings, PROGRESS_DELAY_US)


def around_nixl_agent_init(original: Callable, self: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND hook of `nixl_agent.__init__` (one hook per target: HookRegistry applies a target once): the new
    agent aliases VRAM to DRAM (see the module docstring)."""
    original(self, *args, **kwargs)
    alias_vram_to_dram(self)


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
    if (
        cls is None
        and getattr(transfer_backend, "value", transfer_backend) == _FAKE
        and getattr(class_type, "value", class_type) == "bootstrap_server"
    ):
        from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

        return CommonKVBootstrapServer
    return cls


def around_is_fake_transfer(original: Callable, req: Any) -> bool:
    """With the `fake` backend every request is a fake transfer, whatever bootstrap host the router sent (fix 3)."""
    if original(req):
        return True
    from sglang.srt.runtime_context import get_disagg

    return get_disagg().disaggregation_transfer_backend == _FAKE


_CONN = "sglang.srt.disaggregation"
_PD = "flashmemory.sglang.cpu.pd"

PD_PATCHES: tuple[Patch, ...] = (
    Patch(
        "cpu_pd",
        "nixl._api.nixl_agent.__init__",
        "around",
        f"{_PD}:around_nixl_agent_init",
        ("self", "agent_name"),
        "disaggregation/nixl/conn.py:979 registers host pools as VRAM (UCX refuses it: registerMem -> "
        "NIXL_ERR_BACKEND): every agent aliases VRAM to DRAM (nixl_cu13/_api.py:200)",
        optional=True,
    ),
    Patch(
        "cpu_pd",
        "nixl._api.nixlBind",
        "attr",
        f"{_PD}:delayed_bindings",
        (),
        "nixl_cu13/_api.py:226 builds every agent with pthrDelay = 0 (UCX's progress thread spins a core): "
        "on CPU at least PROGRESS_DELAY_US",
        optional=True,
    ),
    Patch(
        "cpu_pd",
        "sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation",
        "step",
        f"{_PD}:fake_prefill_step",
        ("server_args",),
        "arg_groups/pd_disaggregation_hook.py:146 asserts a prefill server is not `fake` (fix 1)",
    ),
    Patch(
        "cpu_pd",
        "sglang.srt.managers.disagg_service.get_kv_class",
        "around",
        f"{_PD}:around_get_kv_class",
        ("transfer_backend", "class_type"),
        "managers/disagg_service.py:42 fake has no bootstrap server class -> CommonKVBootstrapServer (fix 2)",
    ),
    Patch(
        "cpu_pd",
        f"{_CONN}.utils._is_fake_transfer",
        "around",
        f"{_PD}:around_is_fake_transfer",
        ("req",),
        "disaggregation/utils.py:238 fake only for host 2.2.2.2 -> every request with the fake backend (fix 3)",
    ),
    Patch(
        "cpu_pd",
        f"{_CONN}.decode._is_fake_transfer",
        "around",
        f"{_PD}:around_is_fake_transfer",
        ("req",),
        "disaggregation/decode.py:62 its own binding of utils._is_fake_transfer (fix 3)",
    ),
)
