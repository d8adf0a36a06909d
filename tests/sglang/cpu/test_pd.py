"""NIXL on CPU: host tensors that sglang registers as "VRAM" move for real once the agent aliases VRAM to DRAM."""

import os
import time

import pytest
import torch

nixl_api = pytest.importorskip("nixl._api", reason="nixl is not installed (extra serve-nixl)")

from flashmemory.sglang.cpu import pd  # noqa: E402
from flashmemory.sglang.cpu.platform import CPU_SWITCHES  # noqa: E402

# As the CPU layer does in every sglang process: without it UCX's IB modules make this pytest process
# segfault at exit, after the suite has passed (see CPU_SWITCHES). Read by UCX when the first agent starts.
os.environ.setdefault("UCX_MODULES", CPU_SWITCHES["UCX_MODULES"])


@pytest.fixture(autouse=True)
def shipped_bindings(monkeypatch):
    """Every test starts from nixl's shipped bindings (the `attr` row swaps the module's `nixlBind`)."""
    monkeypatch.setattr(nixl_api, "nixlBind", getattr(nixl_api.nixlBind, "_bindings", nixl_api.nixlBind))


def _agent_cls(patched: bool) -> type:
    """A subclass (the global class stays as shipped); patched: its __init__ runs the PD_PATCHES around-hook as
    HookRegistry's AROUND wrapper does."""
    if not patched:
        return type("Agent", (nixl_api.nixl_agent,), {})

    def __init__(self, *args, **kwargs):
        pd.around_nixl_agent_init(lambda *a, **k: nixl_api.nixl_agent.__init__(*a, **k), self, *args, **kwargs)

    return type("Agent", (nixl_api.nixl_agent,), {"__init__": __init__})


def _read(cls: type, src: torch.Tensor, dst: torch.Tensor, kind: str) -> str:
    """Agent B reads A's `src` into its `dst`, both described as memory type `kind` (sglang's calls).

    Every handle, peer and registration is released before returning: UCX objects left for interpreter
    shutdown to free crash the process at exit (SIGSEGV after the suite had passed)."""
    cfg = nixl_api.nixl_agent_config(backends=["UCX"])
    a, b = cls(f"A{id(src)}", cfg), cls(f"B{id(src)}", cfg)
    regs = [(a, a.register_memory([(src.data_ptr(), src.nbytes, 0, "")], kind))]
    try:
        regs.append((b, b.register_memory([(dst.data_ptr(), dst.nbytes, 0, "")], kind)))
        peer = b.add_remote_agent(a.get_agent_metadata())
        try:
            h = b.initialize_xfer(
                "READ",
                b.get_xfer_descs([(dst.data_ptr(), dst.nbytes, 0)], kind),
                a.get_xfer_descs([(src.data_ptr(), src.nbytes, 0)], kind),
                peer,
            )
            try:
                state = b.transfer(h)
                deadline = time.monotonic() + 30
                while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                    time.sleep(0.005)
                    state = b.check_xfer_state(h)
                return state
            finally:
                b.release_xfer_handle(h)
        finally:
            b.remove_remote_agent(peer)
    finally:
        for agent, reg in reversed(regs):
            agent.deregister_memory(reg)


def test_host_memory_as_vram_is_refused_as_shipped():
    """Why the alias exists: UCX rejects host memory registered as VRAM."""
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    with pytest.raises(Exception, match="NIXL_ERR"):
        _read(_agent_cls(False), src, torch.zeros_like(src), "VRAM")


def test_alias_moves_the_bytes():
    g = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (3, 584 * 64), dtype=torch.uint8, generator=g)  # c4 KV-sized rows
    dst = torch.zeros_like(src)
    assert _read(_agent_cls(True), src, dst, "VRAM") == "DONE"
    assert torch.equal(src, dst)


def test_the_nixl_rows_are_optional_and_name_the_agent_init_and_its_bindings():
    init, bind = [p for p in pd.PD_PATCHES if p.target.startswith("nixl.")]
    assert init.optional and init.kind == "around" and init.impl.endswith(":around_nixl_agent_init")
    assert bind.optional and bind.kind == "attr" and bind.target == "nixl._api.nixlBind"


def test_agents_built_after_the_hook_never_get_a_zero_progress_delay():
    """nixl's __init__ sets pthrDelay = 0 (a spinning UCX progress thread); through the hook's bindings the config
    it builds keeps PROGRESS_DELAY_US, and a larger delay passes through."""
    shipped = nixl_api.nixlBind.nixlAgentConfig()
    shipped.pthrDelay = 0
    assert shipped.pthrDelay == 0
    delayed = pd.delayed_bindings(nixl_api.nixlBind)
    assert pd.delayed_bindings(delayed) is delayed  # idempotent: wraps once
    nixl_api.nixlBind = delayed  # what the row sets (put back by the fixture)
    assert not isinstance(nixl_api.nixlBind._bindings, pd._DelayedBindings)
    cfg = nixl_api.nixlBind.nixlAgentConfig()
    cfg.pthrDelay = 0
    assert cfg.pthrDelay == pd.PROGRESS_DELAY_US
    cfg.pthrDelay = 5 * pd.PROGRESS_DELAY_US
    assert cfg.pthrDelay == 5 * pd.PROGRESS_DELAY_US
    assert nixl_api.nixlBind.nixlAgent is nixl_api.nixlBind._bindings.nixlAgent


def test_a_delayed_agent_still_moves_the_bytes():
    nixl_api.nixlBind = pd.delayed_bindings(nixl_api.nixlBind)  # put back by the fixture
    g = torch.Generator().manual_seed(8)
    src = torch.randint(0, 256, (2, 584 * 64), dtype=torch.uint8, generator=g)
    dst = torch.zeros_like(src)
    assert _read(_agent_cls(True), src, dst, "VRAM") == "DONE"
    assert torch.equal(src, dst)


def test_bindings_without_a_settable_delay_are_refused():
    class Bindings:
        class nixlAgentConfig:
            pass

    with pytest.raises(RuntimeError, match="pthrDelay"):
        pd.delayed_bindings(Bindings)


def test_alias_refuses_an_unknown_agent_layout():
    class NoTable:
        pass

    with pytest.raises(RuntimeError, match="nixl_mems"):
        pd.alias_vram_to_dram(NoTable())
