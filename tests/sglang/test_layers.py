"""`flashmemory/sglang/` laid out by concept: its subpackages import one way (`SGLANG_FLOORS`), each says in its
docstring what it owns and may import, and nothing in it probes the adapter or the offload core for a capability
(`hasattr` / `getattr` on anything named `engine`): both declare what their callers use. The import graph is
`test_import_graph`'s reader (imports inside functions and `TYPE_CHECKING` blocks count).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.sglang.test_import_graph import PKG, _write, import_graph


def capability_probes(files: list[Path], root: Path = PKG.parent) -> list[str]:
    """`hasattr(x, ...)` / `getattr(x, ...)` where x is named `engine` (`engine`, `self.engine`, `RUNTIME.engine`,
    `adapter.engine`, ...): in `flashmemory/sglang/` that is the Path-P adapter (the runtime's `engine`) or, inside
    an adapter, the offload core (its `self.engine`). Both declare every method their callers use (the adapter's
    base class with no-op defaults, the core's verbs), so a probe means a missing default or verb."""
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
                and node.args
                and (lambda x: x == "engine" or x.endswith(".engine"))(ast.unparse(node.args[0]))
            ):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return bad


# `flashmemory/sglang/` by concept, lowest first: a subpackage may import only those on lower floors (and itself).
# The decode path knows neither how it is patched in nor the modes built on it; the plumbing applies the tables
# (recording them in decode's process state); the CPU layer and the HiSparse prefetch mode are tables of their own;
# the entry point (`plugin.py`, the package root) wires them all.
SGLANG_FLOORS: dict[str, int] = {
    "metrics": 0,
    "dump": 0,
    "decode": 1,
    "plumbing": 2,
    "cpu": 3,
    "hisparse": 4,
    "plugin": 5,
    "": 5,  # the package root, flashmemory/sglang/__init__.py
}


def sglang_part(mod: str) -> str | None:
    """The subpackage of `flashmemory.sglang` a module belongs to (a top-level module: its own name), else None."""
    parts = mod.split(".")
    return (parts[2] if len(parts) > 2 else "") if parts[:2] == ["flashmemory", "sglang"] else None


def sglang_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports between `flashmemory/sglang/`'s subpackages that do not go down a floor of SGLANG_FLOORS."""
    bad = []
    for a, deps in sorted(graph.items()):
        pa = sglang_part(a)
        if pa is None:
            continue
        for b in sorted(deps):
            pb = sglang_part(b)
            if pb is None or pb == pa:
                continue
            if pa not in SGLANG_FLOORS or pb not in SGLANG_FLOORS:
                bad.append(f"{a} -> {b}: flashmemory/sglang/{pa if pa not in SGLANG_FLOORS else pb} has no floor")
            elif SGLANG_FLOORS[pb] >= SGLANG_FLOORS[pa]:
                bad.append(f"{a} ({pa}, floor {SGLANG_FLOORS[pa]}) -> {b} ({pb}, floor {SGLANG_FLOORS[pb]})")
    return bad


def test_the_sglang_subpackages_import_one_way() -> None:
    bad = sglang_violations(import_graph(PKG))
    assert not bad, "imports against flashmemory/sglang's floors:\n" + "\n".join(bad)


def test_every_sglang_part_has_a_floor() -> None:
    """A new subpackage or top-level module of `flashmemory/sglang/` gets a floor (and a docstring naming it)."""
    parts = {p.name for p in (PKG / "sglang").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    parts |= {p.stem for p in (PKG / "sglang").glob("*.py") if p.stem != "__init__"}
    assert parts == set(SGLANG_FLOORS) - {""}, sorted(parts ^ (set(SGLANG_FLOORS) - {""}))
    for sub in parts - {"plugin"}:
        doc = ast.get_docstring(ast.parse((PKG / "sglang" / sub / "__init__.py").read_text())) or ""
        assert "May import" in doc or sub == "cpu", f"flashmemory/sglang/{sub}/__init__.py: say what it may import"


def test_the_sglang_floors_catch_an_upward_import(tmp_path: Path) -> None:
    """The check can fail: decode importing the plumbing (inside a function) and metrics importing decode are
    both reported; plumbing importing decode is not."""
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "sglang/__init__.py": "",
            "sglang/plugin.py": "from flashmemory.sglang.plumbing import patching\n",
            "sglang/decode/__init__.py": "",
            "sglang/decode/runtime.py": "def f():\n    from flashmemory.sglang.plumbing.patch_spec import Patch\n",
            "sglang/plumbing/__init__.py": "",
            "sglang/plumbing/patch_spec.py": "",
            "sglang/plumbing/patching.py": "from ..decode import runtime\n",
            "sglang/metrics/__init__.py": "",
            "sglang/metrics/prometheus.py": "import flashmemory.sglang.decode.runtime\n",
        },
    )
    assert sglang_violations(import_graph(pkg)) == [
        "flashmemory.sglang.decode.runtime (decode, floor 1) -> flashmemory.sglang.plumbing.patch_spec "
        "(plumbing, floor 2)",
        "flashmemory.sglang.metrics.prometheus (metrics, floor 0) -> flashmemory.sglang.decode.runtime "
        "(decode, floor 1)",
    ]


def test_no_capability_probes_on_the_adapter_or_the_core() -> None:
    bad = capability_probes(sorted((PKG / "sglang").rglob("*.py")))
    assert not bad, "capability probes on the adapter or the core (declare a default or a verb):\n" + "\n".join(bad)


def test_the_probe_scan_sees_the_adapter_and_the_core(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(self, server_args):\n"
        "    q = getattr(self.engine, 'queued', None)\n"
        "    g = hasattr(RUNTIME.engine, 'queue_gate')\n"
        "    h = getattr(engine, 'x', 0)\n"
        "    ok = getattr(server_args, 'tp_size', 1), getattr(self.engine_rows, 'n', 0)\n"
    )
    found = [line.split(": ", 1)[1] for line in capability_probes([probe], root=tmp_path)]
    assert found == [
        "getattr(self.engine, 'queued', None)",
        "hasattr(RUNTIME.engine, 'queue_gate')",
        "getattr(engine, 'x', 0)",
    ]
