"""Every change FlashMemory makes to an sglang object (or a package sglang calls) is a row of the `Patch` table.

A scan of `flashmemory/sglang/` for code that changes a foreign object by assignment: `setattr` on anything but
`self`; an attribute set to code (a lambda, a function or class of ours, a bound method of ours) or to an
instance of a class of ours (a wrapper hung on someone else's object); an attribute named `flashmemory_*` (a
tag on a foreign object). Such an assignment may only sit in the implementation of a code-kind `Patch` row
(a hook's body acting on the objects sglang hands it, under that row's `why`), in the `import_stub` loader or in
the apply loop itself (`patching.py`); tags never. `KNOWN` lists the sites still to be turned into rows, so a
new one fails here and a converted one must leave the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flashmemory.sglang.plumbing.patch_spec import CODE_KINDS
from flashmemory.sglang.plumbing.patching import all_patches

PKG = Path(__file__).resolve().parents[2] / "flashmemory" / "sglang"
# (file, function) -> what is left to convert into a Patch row.
KNOWN: dict[tuple[str, str], str] = {}


def _impls() -> tuple[set[tuple[str, str]], set[str]]:
    """(file, function) of every code-kind row's impl, and the files of the import_stub loaders."""
    funcs, stub_files = set(), set()
    for p in all_patches():
        if ":" not in p.impl:
            continue
        mod, attr = p.impl.split(":")
        rel = mod.removeprefix("flashmemory.sglang.").replace(".", "/") + ".py"
        if p.kind in CODE_KINDS:
            funcs.add((rel, attr))
        elif p.kind == "import_stub":
            stub_files.add(rel)
    return funcs, stub_files


def _flags(path: Path) -> list[tuple[str, str, str, bool]]:
    """(function, source, rule, is_tag) of every assignment in `path` that changes a foreign object."""
    tree = ast.parse(path.read_text())
    ours = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    # Names of our own objects: imported from flashmemory, or module-level globals of this file.
    own_objects = {
        a.asname or a.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("flashmemory")
        for a in n.names
    }
    own_objects |= {
        t.id
        for n in tree.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    out: list[tuple[str, str, str, bool]] = []

    def visit(node: ast.AST, stack: list[ast.AST]) -> None:
        for ch in ast.iter_child_nodes(node):
            scope = stack + [ch] if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else stack
            name = ".".join(s.name for s in stack)  # type: ignore[attr-defined]
            cls = next((s for s in reversed(stack) if isinstance(s, ast.ClassDef)), None)
            methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} if cls else set()
            local_defs = {
                n.name
                for s in stack
                if isinstance(s, ast.FunctionDef)
                for n in ast.walk(s)
                if isinstance(n, ast.FunctionDef)
            }
            if isinstance(ch, ast.Call) and isinstance(ch.func, ast.Name) and ch.func.id == "setattr":
                if not (ch.args and isinstance(ch.args[0], ast.Name) and ch.args[0].id == "self" and cls):
                    out.append((name, ast.unparse(ch), "setattr", False))
            if isinstance(ch, (ast.Assign, ast.AnnAssign)):
                targets = ch.targets if isinstance(ch, ast.Assign) else [ch.target]
                for t in (e for tg in targets for e in (tg.elts if isinstance(tg, ast.Tuple) else [tg])):
                    if not isinstance(t, ast.Attribute):
                        continue
                    root = t.value
                    while isinstance(root, (ast.Attribute, ast.Subscript)):
                        root = root.value
                    base = root.id if isinstance(root, ast.Name) else None
                    own = (base == "self" and cls is not None) or base in own_objects
                    v = ch.value
                    code = (
                        isinstance(v, ast.Lambda)
                        or (isinstance(v, ast.Name) and v.id in ours)
                        or (
                            isinstance(v, ast.Attribute)
                            and isinstance(v.value, ast.Name)
                            and v.value.id == "self"
                            and v.attr in methods
                        )
                        or (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in classes)
                    )
                    tag = t.attr.startswith("flashmemory_") and base not in local_defs
                    if (code and not own) or tag:
                        out.append((name, ast.unparse(ch)[:90], "tag" if tag else "code", tag))
            visit(ch, scope)

    visit(tree, [])
    return out


def test_the_scan_sees_each_form_of_mutation(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "class View:\n    pass\n\n\ndef f(pool, mod):\n    pool.seam = pool.translate\n"
        "    mod.platform = View()\n    setattr(mod, 'x', 1)\n    pool.flashmemory_pages = 3\n"
        "    pool.size = 3\n\n\nclass C:\n    def m(self):\n        self.x = self.m\n"
        "    def n(self, pool):\n        pool.hook = self.m\n"
    )
    rules = [(fn, rule) for fn, _, rule, _ in _flags(src)]
    assert rules == [("f", "code"), ("f", "setattr"), ("f", "tag"), ("C.n", "code")], rules


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_mutation_of_sglang_outside_the_patch_table(path):
    rel = str(path.relative_to(PKG))
    impls, stub_files = _impls()
    found = {}
    for fn, src, rule, tag in _flags(path):
        top = fn.split(".")[0]
        if (
            rel in stub_files
            or rel == "plumbing/patching.py"
            or (not tag and ((rel, fn) in impls or (rel, top) in impls))
        ):
            continue
        found.setdefault((rel, fn), []).append(f"{rule}: {src}")
    known = {k for k in KNOWN if k[0] == rel}
    assert set(found) == known, (
        f"{rel}: changes to sglang objects outside the Patch table (make them rows of a "
        f"table in patching.TABLES): {found}; still listed in KNOWN: {known - set(found)}"
    )
