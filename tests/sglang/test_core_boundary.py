"""No file under `flashmemory/sglang/` reaches into the offload core's parts or takes its lock.

The core (`flashmemory.offload.OffloadEngine`) keeps its host mirror, device reserve, lookup table, target index
pool, recaller, block list, LRU, resident tables, forward order and lock to itself; the adapter talks to it
through the verbs `OffloadEngine` documents and translates sglang's addresses into them. This scan finds every
attribute read of one of those parts on an expression that holds the core: `self.engine` inside an adapter
class (a subclass of `OffloadAdapter`), `<x>.engine.engine`, `engine.engine` and `adapter.engine` (the runtime's
adapter's core),
a parameter annotated with a core class, and a local name assigned from any of these. `KNOWN` counts the sites
per (file, function) still to be converted, so a new one fails here and a converted one must leave the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "flashmemory" / "sglang"
# The core's parts: what the adapter must not name on the core.
PARTS = frozenset(
    {
        "mirror",
        "reserve",
        "lut",
        "target",
        "recaller",
        "blocks",
        "lru",
        "owner",
        "inflight",
        "rows",
        "tables",
        "res_pages",
        "res_blocks",
        "res_mpages",
        "res_count",
        "order",
        "stats",
        "staging",
        "copy_lock",
        "lock",
        "copy_hook",
    }
)
CORE_CLASSES = frozenset({"OffloadEngine", "TieredEngine"})
ADAPTER_CLASSES = frozenset({"OffloadAdapter", "CopyAdapter", "ShrinkAdapter"})
# (file, function) -> reach-throughs still to convert.
KNOWN: dict[tuple[str, str], int] = {}


def _is_core(node: ast.AST, in_adapter: bool, names: set[str]) -> bool:
    """Whether expression `node` holds the offload core."""
    if isinstance(node, ast.Name):
        return node.id in names or node.id == "eng"
    if not (isinstance(node, ast.Attribute) and node.attr == "engine"):
        return False
    v = node.value
    if isinstance(v, ast.Name) and (v.id in ("adapter", "engine") or (v.id == "self" and in_adapter)):
        return True
    return isinstance(v, ast.Attribute) and v.attr == "engine"


def _annotated_core(arg: ast.arg) -> bool:
    return arg.annotation is not None and any(c in ast.unparse(arg.annotation) for c in CORE_CLASSES)


def reach_throughs(path: Path) -> list[tuple[str, int, str]]:
    """(function qualname, line, source) of every read of a core part in `path`."""
    tree = ast.parse(path.read_text())
    out: list[tuple[str, int, str]] = []

    def scan_function(
        fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, qual: str, in_adapter: bool, outer: set[str]
    ) -> None:
        names = set(outer) | {a.arg for a in fn.args.args + fn.args.kwonlyargs if _annotated_core(a)}
        body = fn.body if isinstance(fn.body, list) else [fn.body]
        # Local names bound to the core: `eng = self.engine`, `eng, lay = self.engine, self.layout`.
        for node in (n for stmt in body for n in ast.walk(stmt)):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    both = isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                    pairs = zip(t.elts, node.value.elts) if both else [(t, node.value)]
                    for tgt, val in pairs:
                        if isinstance(tgt, ast.Name) and _is_core(val, in_adapter, names):
                            names.add(tgt.id)
        for node in (n for stmt in body for n in ast.walk(stmt)):
            if isinstance(node, ast.Attribute) and node.attr in PARTS and _is_core(node.value, in_adapter, names):
                out.append((qual, node.lineno, ast.unparse(node)))

    def visit(node: ast.AST, qual: str, in_adapter: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.ClassDef):
                bases = {ast.unparse(b).split(".")[-1] for b in ch.bases}
                visit(ch, f"{qual}{ch.name}.", ch.name in ADAPTER_CLASSES or bool(bases & ADAPTER_CLASSES))
            elif isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scan_function(ch, qual + ch.name, in_adapter, set())
            else:
                visit(ch, qual, in_adapter)

    visit(tree, "", False)
    # A nested function is scanned with its parent; count each site once.
    return sorted(set(out), key=lambda t: t[1])


def all_sites() -> dict[tuple[str, str], list[tuple[int, str]]]:
    sites: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for qual, line, src in reach_throughs(path):
            sites.setdefault((str(path.relative_to(PKG)), qual), []).append((line, src))
    return sites


def test_no_file_under_sglang_reaches_into_the_core() -> None:
    sites = all_sites()
    new = {k: v for k, v in sites.items() if len(v) > KNOWN.get(k, 0)}
    assert not new, "reach-throughs into the offload core (use its verbs, see OffloadEngine):\n" + "\n".join(
        f"  {f}:{line} {q}: {src}" for (f, q), v in new.items() for line, src in v
    )


def test_known_list_is_current() -> None:
    """A converted site leaves `KNOWN`, so the list only shrinks."""
    sites = all_sites()
    stale = {k: (n, len(sites.get(k, []))) for k, n in KNOWN.items() if len(sites.get(k, [])) < n}
    assert not stale, f"KNOWN lists more reach-throughs than remain (known, now): {stale}; lower or drop them"


@pytest.mark.parametrize(
    "src",
    [
        "class A(OffloadAdapter):\n    def f(self):\n        return self.engine.mirror.kv\n",
        "class A(OffloadAdapter):\n    def f(self):\n        with self.engine.lock:\n            pass\n",
        "class A(OffloadAdapter):\n    def f(self):\n        eng, pc = self.engine, 64\n        return eng.reserve\n",
        "def f(adapter):\n    return len(adapter.engine.blocks)\n",
        "def f(eng: OffloadEngine):\n    return eng.lut.table\n",
        "def f(rt):\n    rt.engine.engine.order.end_forward()\n",
    ],
)
def test_scan_finds_a_reach_through(tmp_path: Path, src: str) -> None:
    p = tmp_path / "m.py"
    p.write_text(src)
    assert len(reach_throughs(p)) == 1


def test_scan_ignores_the_adapters_own_state_and_the_cores_verbs(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text(
        "class R:\n    def f(self):\n        return self.engine.rows, self.engine.stats()\n"
        "class A(OffloadAdapter):\n    def g(self):\n        return self.rows, self.engine.cell_table()\n"
    )
    assert reach_throughs(p) == []
