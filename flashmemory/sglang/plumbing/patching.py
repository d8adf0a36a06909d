"""The one apply-and-verify loop for every `Patch` (see `patch_spec`), and the registry of patch tables.

`TABLES` lists every table module ("module:NAME", a tuple of `Patch`); `all_patches()` reads them in that order,
`select(features, kinds)` picks the rows of the active features, `apply(patches)` applies them:

1. check: every code target resolves and its leading parameters are as listed (`TargetError` otherwise);
   every impl loads. An `optional` patch whose package is absent is skipped.
2. apply, by kind: `env` rows through `flashmemory.env.set_defaults` (the user's value wins, and is logged);
   `import_stub` rows through their stub installer; `step` rows through sglang's `register_resolution_hook`
   (verified: sglang's list of wrappers for that step now holds ours);
   hook rows (`before/after/around/replace`) registered with sglang's `HookRegistry` and applied at once;
   `attr` rows set on their module to what their builder returns.
3. verify: HookRegistry only logs a target that fails to apply (and sglang's `load_plugins` swallows
   exceptions), so each hook target is re-read and must now wrap the original; an `attr` target must now be
   the object its builder returned.

Any failure is a `StartupError` (a SystemExit: "FlashMemory startup error: ..."), which does stop sglang.
Each patch is applied once per process (both plugin entry points may run; the second call is a no-op).

Our callables reach sglang as they are: the per-request failure guard wraps FlashMemory's hooks where they are
defined (`hooks.py`), so the table's `impl` is exactly the callable sglang calls.
"""

from __future__ import annotations

import logging
import pkgutil
from collections.abc import Iterable
from typing import Any

from flashmemory.sglang.plumbing.patch_spec import (
    CODE_KINDS,
    HOOK_KINDS,
    Patch,
    StartupError,
    TargetError,
    check_signature,
    resolve,
    target_present,
    unwrap,
)

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it

# Every table of patches, in apply order. A new table module adds its "module:NAME" here (and nothing else).
TABLES: tuple[str, ...] = (
    "flashmemory.sglang.cpu.platform:PLATFORM_PATCHES",  # env switches + import stubs (platform activation)
    "flashmemory.sglang.cpu.patches_kernels:KERNEL_PATCHES",  # CUDA-only kernels -> pure-torch drop-ins
    "flashmemory.sglang.cpu.patches_runtime:RUNTIME_PATCHES",  # CPU seams outside the kernels
    "flashmemory.sglang.cpu.patches_tp:TP_PATCHES",  # --tp N on CPU: thread groups, gloo, DSv4's KV head
    "flashmemory.sglang.cpu.patches_tiny:TINY_PATCHES",  # a tiny trained model's sliding window
    "flashmemory.sglang.cpu.patches_hisparse:HISPARSE_PATCHES",  # HiSparse (--enable-hisparse) on CPU
    "flashmemory.sglang.cpu.pd:PD_PATCHES",  # PD on CPU: NIXL over DRAM, the `fake` backend
    "flashmemory.sglang.plumbing.targets:SPECS",  # FlashMemory's own hooks
    "flashmemory.sglang.hisparse.prefetch:PREFETCH_PATCHES",  # prefetch into sglang's HiSparse hot buffer
)
SWA_FEATURE = "cpu_swa_window"  # on with SGLANG_FLASHMEMORY_CPU_SWA_WINDOW (and the CPU layer)
CPU_FEATURES = ("cpu", "cpu_pd")  # on with SGLANG_FLASHMEMORY_CPU=1, independent of the FlashMemory gates
PLATFORM_KINDS = ("env", "import_stub")  # applied at platform activation, before sglang imports its kernels


def all_patches() -> tuple[Patch, ...]:
    """Every row of every table in `TABLES` (imports the table modules; none of them imports sglang)."""
    out: list[Patch] = []
    for ref in TABLES:
        out.extend(pkgutil.resolve_name(ref))
    return tuple(out)


def tiny_features(geometry: Any) -> tuple[str, ...]:
    """The tiny-model rows of the CPU layer (`cpu/patches_tiny.py`) a `flashmemory.env.CpuTinyGeometry` turns on:
    none unless SGLANG_FLASHMEMORY_CPU_SWA_WINDOW is set."""
    return (SWA_FEATURE,) if geometry.swa_window else ()


def cpu_features(geometry: Any) -> tuple[str, ...]:
    """The CPU layer's features: CPU_FEATURES plus `tiny_features(geometry)`."""
    return CPU_FEATURES + tiny_features(geometry)


def active_features(env: Any) -> tuple[str, ...]:
    """Features a `FlashMemoryEnv` turns on: the CPU layer's (SGLANG_FLASHMEMORY_CPU) and the hook features."""
    from flashmemory.sglang.plumbing.targets import features_for

    return (CPU_FEATURES if env.cpu else ()) + features_for(env)


def select(
    features: Iterable[str], kinds: Iterable[str] | None = None, patches: tuple[Patch, ...] | None = None
) -> list[Patch]:
    """Rows of the given features (and kinds), in table order, one per (target, kind, impl): a hook that two
    features share is applied once."""
    feats, kind_set = set(features), set(kinds) if kinds is not None else None
    seen: set[tuple[str, str, str]] = set()
    out = []
    for p in all_patches() if patches is None else patches:
        key = (p.target, p.kind, p.impl)
        if p.feature in feats and (kind_set is None or p.kind in kind_set) and key not in seen:
            seen.add(key)
            out.append(p)
    return out


def load_impl(spec: Patch) -> Any:
    """Our callable for `spec` ("module:attr"); StartupError naming the patch when it cannot be loaded."""
    try:
        return pkgutil.resolve_name(spec.impl)
    except Exception as e:
        raise StartupError(f"{spec.target}: cannot load {spec.impl} ({type(e).__name__}: {e})") from None


def check_all(patches: list[Patch]) -> dict[str, Any]:
    """Check every code target (exists, leading parameters) and return {target: its current value}; the
    `optional` ones whose package is absent are left out. Raises TargetError on the first bad target."""
    originals: dict[str, Any] = {}
    for p in patches:
        if p.kind in CODE_KINDS and target_present(p):
            value = check_signature(p)
            originals.setdefault(p.target, value)
    return originals


def verify(patches: list[Patch], originals: dict[str, Any]) -> list[str]:
    """Hook targets whose current attribute is still the original (or does not wrap it): not applied."""
    bad = []
    for p in patches:
        if p.kind not in HOOK_KINDS or p.target not in originals:
            continue
        try:
            _, _, now = resolve(p.target)
        except TargetError as e:
            bad.append(str(e))
            continue
        orig = originals[p.target]
        if now is orig or unwrap(now) is not unwrap(orig):
            bad.append(f"{p.target} is not patched (see the 'Failed to apply hooks' log line above)")
    return bad


def _apply_env(rows: list[Patch], environ: Any) -> None:
    from flashmemory.env import set_defaults

    differ = set_defaults({p.target: p.impl for p in rows}, environ)
    if differ:
        logger.warning("FlashMemory CPU: user-set switches kept: %s", differ)


def _apply_stubs(rows: list[Patch]) -> None:
    by_impl: dict[str, list[str]] = {}
    for p in rows:
        by_impl.setdefault(p.impl, []).append(p.target)
    for impl, packages in by_impl.items():
        load_impl(next(p for p in rows if p.impl == impl))(tuple(packages))


def _apply_steps(rows: list[Patch]) -> None:
    if not rows:  # importing sglang here, from the platform plugin's activate(), would run sglang's platform
        return  # discovery again inside it (a first import of sglang does that)
    from sglang.srt.arg_groups import resolution_hooks

    for p in rows:
        name, fn = p.target.rsplit(".", 1)[1], load_impl(p)
        try:
            resolution_hooks.register_resolution_hook(name)(fn)
        except ValueError as e:  # not an overridable step in this sglang
            raise StartupError(f"{p.target}: {e}") from None
        # verify: the wrappers `run_hook` chains for this step name must now include ours
        if fn not in getattr(resolution_hooks, "_HOOKS", {}).get(name, ()):
            raise StartupError(f"{p.target} is not wrapped (sglang's resolution hooks did not keep {p.impl})")


def _apply_hooks(rows: list[Patch], originals: dict[str, Any]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    impls = [(p, load_impl(p)) for p in rows]  # all load before any registers
    for p, fn in impls:
        HookRegistry.register(p.target, fn, HookType(p.kind))
    HookRegistry.apply_hooks()
    bad = verify(rows, originals)
    if bad:
        raise StartupError("patches did not apply: " + "; ".join(bad))


def _apply_attrs(rows: list[Patch], originals: dict[str, Any]) -> None:
    for p in rows:
        owner, attr, _ = resolve(p.target)
        try:
            built = load_impl(p)(originals[p.target])
        except Exception as e:  # a builder refuses what it found (e.g. a package release it does not support)
            raise StartupError(f"{p.target}: {e}") from None
        setattr(owner, attr, built)
        if resolve(p.target)[2] is not built:
            raise StartupError(f"{p.target} is not replaced (setting {attr!r} on {owner!r} did not hold)")


def apply(patches: list[Patch], *, environ: Any = None, context: str = "") -> list[str]:
    """Check, apply and verify `patches` (those not applied in this process yet); returns the sorted targets of
    all `patches` that are in effect (optional ones whose package is absent are left out). `environ` is for
    `env` rows (default the process environment); `context` is appended to a target error. What was applied is
    recorded in the process state (`runtime.RUNTIME.applied_patches`)."""
    from flashmemory.sglang.decode.runtime import RUNTIME

    done = RUNTIME.applied_patches
    todo = [p for p in patches if (p.target, p.kind, p.impl) not in done and target_present(p)]
    # env and import_stub rows are idempotent by themselves and re-run each time (a test may reset the env).
    try:
        originals = check_all(todo)
    except TargetError as e:
        raise StartupError(f"{e}{context}") from None
    for p in todo:
        if p.kind in CODE_KINDS or p.kind == "import_stub":
            load_impl(p)
    _apply_env([p for p in todo if p.kind == "env"], environ)
    _apply_stubs([p for p in todo if p.kind == "import_stub"])
    _apply_steps([p for p in todo if p.kind == "step"])
    hooks = [p for p in todo if p.kind in HOOK_KINDS]
    if hooks:
        _apply_hooks(hooks, originals)
    _apply_attrs([p for p in todo if p.kind == "attr"], originals)
    for p in todo:
        if p.kind in CODE_KINDS:
            done[(p.target, p.kind, p.impl)] = p.target
    if todo:
        logger.info(
            "FlashMemory: %d sglang patches applied (%s)", len(todo), ", ".join(sorted({p.feature for p in todo}))
        )
    return sorted({p.target for p in patches if target_present(p)})


def applied() -> list[str]:
    """Targets patched in this process so far (sorted)."""
    from flashmemory.sglang.decode.runtime import RUNTIME

    return sorted(set(RUNTIME.applied_patches.values()))
