"""No module-level mutable state in `flashmemory/sglang/` besides the one per-process object, `runtime.RUNTIME`.

A scan of every module: a module-level name bound to an object instance (a call other than an immutable factory),
or to a dict / list / set that some code of the package then changes (item or attribute assignment, a mutating
method, or a `global` rebinding), is process state, and belongs in `RUNTIME` (or an object passed along).
Constant tables (dicts never written after import), frozen values, loggers and aliases are fine. `KNOWN` lists
the singletons still to be folded (none), so a new one fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "flashmemory" / "sglang"
PROCESS_STATE = {("decode/runtime.py", "RUNTIME")}  # the one per-process object
# (file, name) -> why it is still a singleton of its own: none remain.
KNOWN: dict[tuple[str, str], str] = {}
IMMUTABLE_FACTORIES = {
    "frozenset",
    "tuple",
    "getLogger",
    "compile",
    "TypeVar",
    "namedtuple",
    "NewType",
    "object",
    "float",
    "int",
    "str",
    "bytes",
    "Patch",
    "MappingProxyType",
    "finfo",
}
MUTATORS = {
    "append",
    "extend",
    "update",
    "add",
    "pop",
    "popitem",
    "clear",
    "setdefault",
    "remove",
    "discard",
    "insert",
    "__setitem__",
}


def _call_name(v: ast.AST) -> str:
    f = v.func if isinstance(v, ast.Call) else v
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def module_state(files: list[Path], root: Path) -> set[tuple[str, str]]:
    """(file, name) of every module-level mutable singleton in `files` (see the module docstring)."""
    bound: dict[str, dict[str, ast.AST]] = {}
    trees = {str(f.relative_to(root)): ast.parse(f.read_text()) for f in files}
    for rel, tree in trees.items():
        names: dict[str, ast.AST] = {}
        for n in tree.body:
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    if isinstance(t, ast.Name):
                        names[t.id] = n.value
        bound[rel] = names
    mutated: set[str] = set()
    rebound: set[tuple[str, str]] = set()
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                rebound |= {(rel, n) for n in node.names}
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else ([node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            )
            for t in targets:
                if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name):
                    mutated.add(t.value.id)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Name)
            ):
                mutated.add(node.func.value.id)
    out = set(rebound)
    for rel, names in bound.items():
        for name, v in names.items():
            instance = isinstance(v, ast.Call) and _call_name(v) not in IMMUTABLE_FACTORIES
            container = isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
            if instance or (container and name in mutated):
                out.add((rel, name))
    return out


def test_the_scan_sees_instances_written_containers_and_global_rebinding(tmp_path):
    (tmp_path / "m.py").write_text(
        "import logging\nlogger = logging.getLogger(__name__)\nTABLE = {'a': 1}\nSEEN = {}\nLATER = None\n"
        "STATE = Counter()\nKEYS = tuple(TABLE)\n\n\ndef f():\n    global LATER\n    LATER = 1\n    SEEN['x'] = 1\n"
    )
    assert module_state([tmp_path / "m.py"], tmp_path) == {("m.py", "SEEN"), ("m.py", "LATER"), ("m.py", "STATE")}


def test_no_module_level_mutable_state_but_the_process_object():
    found = module_state(sorted(PKG.rglob("*.py")), PKG) - PROCESS_STATE
    assert found == set(KNOWN), (
        f"module-level mutable state outside runtime.RUNTIME (fold it into the process "
        f"state): {sorted(found - set(KNOWN))}; folded but still in KNOWN: "
        f"{sorted(set(KNOWN) - found)}"
    )


@pytest.mark.parametrize(
    "name",
    [
        "_APPLIED",
        "_STATE",
        "guard_hook",
        "_VIEW_LOCK",
        "GUARD",
        "_FAILURE_COUNTER",
        "SWAPIN",
        "_TRACE",
        "_TRACE_LOCK",
        "_NEWEST_PENDING",
        "PREFETCH",
        "HINT",
    ],
)
def test_folded_singletons_stay_gone(name):
    from flashmemory.sglang import plugin
    from flashmemory.sglang.cpu import hisparse_record, patches_hisparse, patches_runtime
    from flashmemory.sglang.decode import guard, hooks
    from flashmemory.sglang.hisparse import prefetch, state
    from flashmemory.sglang.metrics import prometheus
    from flashmemory.sglang.plumbing import patching

    mods = (patching, plugin, patches_runtime, guard, hooks, prometheus, prefetch, patches_hisparse)
    mods += (hisparse_record, state)
    assert not any(hasattr(m, name) for m in mods)
