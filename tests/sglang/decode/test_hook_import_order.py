"""The hooks' guard does not depend on which hook module is imported first.

Every hook runs under the process state's guard (`RUNTIME.guard`, `guard.guarded`). It used to be built as a side
effect of importing `hooks.py`, so a hook module imported without it (`queue_gate`, whose row the patch table may
load on its own, or the shrink hooks split off `hooks.py`) wrapped its hooks around a guard that did not exist:
the first call failed with `'NoneType' object has no attribute 'run'`, and fault injection could not name its
hooks. Now the first hook module imported builds the guard and each registers its own hook names. Each case
runs in a fresh interpreter: the import order is the thing under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashmemory.sglang.plumbing.targets import SPECS

PROBE = r"""
import importlib, json, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
from flashmemory.sglang.decode.runtime import RUNTIME
g = RUNTIME.guard
print(json.dumps(None if g is None else {"names": list(g.hook_names), "precheck": g.precheck is not None}))
"""
# `step` rows run in the launcher process, before any scheduler exists: outside the guard by design (a refusal
# must reach the launcher as the SystemExit it is); test_launcher_step_is_not_guarded pins that.
SCHEDULER_SPECS = tuple(p for p in SPECS if p.kind != "step")
HOOK_MODULES = sorted({p.impl.split(":")[0] for p in SCHEDULER_SPECS})


def _guard_after_importing(*modules: str) -> dict | None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _hooks_of(module: str) -> set[str]:
    return {p.impl.split(":")[1] for p in SCHEDULER_SPECS if p.impl.split(":")[0] == module}


def test_the_table_names_more_than_one_hook_module() -> None:
    assert len(HOOK_MODULES) >= 3, HOOK_MODULES  # hooks, shrink_hooks, queue_gate


@pytest.mark.parametrize("module", HOOK_MODULES)
def test_a_hook_module_imported_alone_runs_its_hooks_under_a_guard(module: str) -> None:
    got = _guard_after_importing(module)
    assert got is not None, f"importing {module} alone leaves RUNTIME.guard None: its hooks would fail at once"
    assert _hooks_of(module) <= set(got["names"]), (module, got)


def test_every_order_ends_with_one_guard_over_every_hook() -> None:
    """Imported in reverse order (the admission precheck's module last), the guard knows every hook of the table
    and runs the precheck."""
    got = _guard_after_importing(*reversed(HOOK_MODULES))
    assert got is not None and got["precheck"], got
    assert {p.impl.split(":")[1] for p in SCHEDULER_SPECS} <= set(got["names"]), got


def test_launcher_step_is_not_guarded() -> None:
    """The launcher's refusal raises its StartupError itself: no guard turns it into a scheduler stop."""
    from flashmemory.sglang.decode.refusals import StartupError
    from flashmemory.sglang.decode.resolution_step import refuse_at_resolution

    steps = {p.impl for p in SPECS if p.kind == "step"}
    assert steps == {"flashmemory.sglang.decode.resolution_step:refuse_at_resolution"}, steps
    assert not hasattr(refuse_at_resolution, "__wrapped__")  # functools.wraps of `guarded` would set it
    args = type("Args", (), {"enable_two_batch_overlap": True})()
    import flashmemory.sglang.decode.resolution_step as rs

    old = rs.RUNTIME.features
    try:
        rs.RUNTIME.features = ("level2",)
        with pytest.raises(StartupError, match="--enable-two-batch-overlap"):
            refuse_at_resolution(args, lambda a: None)
    finally:
        rs.RUNTIME.features = old
