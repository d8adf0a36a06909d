"""`Patch`: the one form of every change FlashMemory makes to sglang, and the checks of its target.

Every patch is a row of data in a table (`patching.TABLES` lists the table modules): which feature needs it,
what it patches, how, with which of our callables, which leading parameters that callable relies on, and why
(the sglang file:line it covers). Kinds:

- `before` / `after` / `around` / `replace`: a function, method or staticmethod of sglang (or of a package
  sglang calls, e.g. `nixl._api.nixl_agent.__init__`), patched through sglang's `HookRegistry`, which also
  rebinds every `from X import Y` copy. `target` is its dotted path, `impl` our callable ("module:attr").
- `step`: a wrapper of one of sglang's server-argument resolution steps (`register_resolution_hook(name)`,
  sglang's own seam); `target` is the dotted path of the built-in step function.
- `attr`: a module-level object of sglang (not a function) replaced, in that one module only, by the object our
  builder makes from it: `impl(current) -> replacement`. `from X import Y` copies elsewhere keep the original,
  so the change reaches exactly the code of that module. Applied once per process and verified like a hook.
- `env`: one of sglang's environment switches, set before sglang reads it unless the user set it; `target` is
  the variable name, `impl` the value.
- `import_stub`: a CUDA-only package that is replaced by a raising stand-in when it cannot import on this host
  (`cpu/stubs.py`); `target` is the package name, `impl` the stub finder.

Importing this module imports no sglang: `resolve` and `check_signature` import the target lazily.
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any

from flashmemory.sglang.decode.refusals import StartupError  # noqa: F401  (re-exported: the apply loop raises it)

HOOK_KINDS = ("before", "after", "around", "replace")  # applied through sglang's HookRegistry
# Applied when a plugin registers; the target must resolve (a function's leading parameters are checked too).
CODE_KINDS = HOOK_KINDS + ("step", "attr")
KINDS = CODE_KINDS + ("env", "import_stub")


class TargetError(RuntimeError):
    """A patch target is missing from the installed sglang or its signature changed."""


@dataclass(frozen=True)
class Patch:
    """One change to sglang.

    feature: the gate that turns it on ("level2", "path_p", ..., "cpu", "cpu_pd"; `patching.active_features`).
    target:  dotted path of the function or object (code kinds), variable name (`env`) or package name
             (`import_stub`).
    kind:    one of KINDS.
    impl:    "module:attr" of our callable (code kinds, `import_stub`) or the value to set (`env`).
    params:  leading parameter names of the target that `impl` relies on, in order (code kinds; checked
             against the installed sglang so a rename upstream fails loudly instead of binding the wrong value).
    why:     the sglang file:line the patch covers, and what it does instead.
    optional: the target lives in an optional extra (e.g. nixl); absent, the patch is skipped, not an error.
    """

    feature: str
    target: str
    kind: str
    impl: str
    params: tuple[str, ...] = ()
    why: str = ""
    optional: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Patch {self.target}: kind {self.kind!r} is not one of {KINDS}")
        if not self.why:
            raise ValueError(f"Patch {self.target}: 'why' (the sglang file:line it covers) is empty")


def resolve(target: str) -> tuple[Any, str, Any]:
    """(owner object, attribute name, current attribute value, unwrapped from classmethod/staticmethod)."""
    owner_path, attr = target.rsplit(".", 1)
    try:
        owner = pkgutil.resolve_name(owner_path)
    except Exception as e:  # ImportError, AttributeError, or an import-time error inside sglang
        raise TargetError(f"patch target {target}: cannot import {owner_path}: {type(e).__name__}: {e}") from None
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if raw is None and not hasattr(owner, attr):
        raise TargetError(f"patch target {target}: {owner_path} has no attribute {attr!r} (sglang changed?)")
    value = getattr(owner, attr)
    if isinstance(raw, (classmethod, staticmethod)):
        value = raw.__func__
    return owner, attr, value


def unwrap(fn: Any) -> Any:
    """Follow `__wrapped__` (HookRegistry and functools.wraps set it) to the original function."""
    seen = 0
    while hasattr(fn, "__wrapped__") and seen < 64:
        fn, seen = fn.__wrapped__, seen + 1
    return fn


def leading_params(fn: Any, target: str) -> list[str]:
    """Parameter names of `fn` (unwrapped), in order; TargetError when it has no inspectable signature."""
    try:
        return list(inspect.signature(unwrap(fn)).parameters)
    except (TypeError, ValueError) as e:
        raise TargetError(f"patch target {target}: no inspectable signature ({e})") from None


def check_signature(spec: Patch) -> Any:
    """Resolve a code-kind target and raise TargetError unless its leading parameters are exactly
    `spec.params`, in order. Returns the current value of the target (what a hook will wrap)."""
    _, _, fn = resolve(spec.target)
    if spec.kind in CODE_KINDS and spec.params:
        names = leading_params(fn, spec.target)
        want = list(spec.params)
        if names[: len(want)] != want:
            raise TargetError(
                f"patch target {spec.target}: expected leading parameters {want}, "
                f"found {names[: len(want) + 2]} (sglang signature drift)"
            )
    return fn


def target_present(spec: Patch) -> bool:
    """False when an `optional` patch's package is not installed (then it is skipped); True otherwise."""
    if not spec.optional:
        return True
    import importlib.util

    top = spec.target.split(".", 1)[0]
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False
