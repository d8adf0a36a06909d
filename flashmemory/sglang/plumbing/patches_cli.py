"""`flashmemory patches`: every change FlashMemory makes to sglang, printed from the patch tables.

One row per `Patch` of `patching.all_patches()` (feature, kind, target, implementation, why). `--check` resolves
every code target in the installed sglang and checks its leading parameters (exit 2 naming the first drifted
target); `--markdown` prints the README block and `--write FILE` replaces that block in FILE in place (a test
checks the block in `flashmemory/sglang/plumbing/README.md` equals the generated one).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flashmemory.atomic import atomic_write_text
from flashmemory.errors import UserError
from flashmemory.sglang.plumbing.patch_spec import CODE_KINDS, Patch

BEGIN = "<!-- BEGIN PATCH TABLE (flashmemory patches --markdown) -->"
END = "<!-- END PATCH TABLE -->"
_PREFIX = "flashmemory.sglang."


def rows(features: list[str] | None = None) -> list[Patch]:
    """Every patch in table order, or those of `features` (UserError naming --features for an unknown one)."""
    from flashmemory.sglang.plumbing.patching import all_patches

    allp = list(all_patches())
    if not features:
        return allp
    known = sorted({p.feature for p in allp})
    bad = [f for f in features if f not in known]
    if bad:
        raise UserError(f"--features: unknown feature(s) {bad}; known: {', '.join(known)}")
    return [p for p in allp if p.feature in features]


def _impl(p: Patch) -> str:
    return p.impl[len(_PREFIX) :] if p.impl.startswith(_PREFIX) else p.impl


def as_text(ps: list[Patch]) -> str:
    """One line per patch: feature, kind, target, implementation (the value for `env`), then why indented."""
    lines = [f"{'FEATURE':<10} {'KIND':<11} TARGET -> IMPLEMENTATION", f"{'':<22} why"]
    for p in ps:
        arrow = "=" if p.kind == "env" else "->"
        opt = " (optional)" if p.optional else ""
        lines.append(f"{p.feature:<10} {p.kind:<11} {p.target} {arrow} {_impl(p)}{opt}")
        lines.append(f"{'':<22} {p.why}")
    lines.append(
        f"{len(ps)} patches, {len({p.target for p in ps})} targets, kinds: {', '.join(sorted({p.kind for p in ps}))}"
    )
    return "\n".join(lines)


def as_json(ps: list[Patch]) -> str:
    return json.dumps(
        [
            {
                "feature": p.feature,
                "kind": p.kind,
                "target": p.target,
                "impl": p.impl,
                "params": list(p.params),
                "why": p.why,
                "optional": p.optional,
            }
            for p in ps
        ],
        indent=1,
    )


def as_markdown(ps: list[Patch]) -> str:
    """The README block (markers included)."""
    lines = [BEGIN, "| Feature | Kind | Target | Implementation | Why (sglang file:line) |", "|---|---|---|---|---|"]
    for p in ps:
        opt = " (optional)" if p.optional else ""
        why = p.why.replace("|", "/")
        lines.append(f"| {p.feature} | {p.kind} | `{p.target}`{opt} | `{_impl(p)}` | {why} |")
    lines.append(END)
    return "\n".join(lines)


def write_block(path: str, block: str) -> None:
    """Replace the text between BEGIN and END (inclusive) in `path` with `block`, atomically."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise UserError(f"{path}: no patch table markers ({BEGIN} ... {END})")
    atomic_write_text(path, head + block + tail)


def check(ps: list[Patch]) -> tuple[int, int]:
    """Resolve every code target and check its leading parameters, in table order; UserError naming the first
    that drifted. Returns (checked, optional skipped)."""
    from flashmemory.sglang.plumbing.patch_spec import TargetError, check_signature, target_present

    done = skipped = 0
    for p in ps:
        if p.kind not in CODE_KINDS:
            continue
        if not target_present(p):
            skipped += 1
            continue
        try:
            check_signature(p)
        except TargetError as e:
            raise UserError(f"{p.feature}: {e}") from None
        done += 1
    return done, skipped


def run(args: argparse.Namespace) -> int:
    features = [f.strip() for f in args.features.split(",") if f.strip()] if args.features else None
    ps = rows(features)
    if args.write:
        block = as_markdown(rows())  # the README block always lists every patch
        for path in args.write:
            write_block(path, block)
            print(f"wrote the patch table ({len(rows())} rows) into {path}")
        return 0
    if args.check:
        done, skipped = check(ps)
        print(
            f"ok: {done} code targets resolve with their leading parameters in the installed sglang"
            + (f" ({skipped} optional skipped: package not installed)" if skipped else "")
        )
        return 0
    print(as_json(ps) if args.json else as_markdown(ps) if args.markdown else as_text(ps))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "patches",
        help="list every patch FlashMemory applies to sglang (--check: against the installed sglang)",
        description="Every change FlashMemory makes to sglang, one row per patch: the feature (gate) that needs it, "
        "the kind (before/after/around/replace: a function through sglang's HookRegistry; step: a "
        "server-argument resolution step; env: an environment switch set unless the user set it; "
        "import_stub: a CUDA-only package stubbed when it cannot import), the target, our "
        "implementation and why (the sglang file:line it covers).",
    )
    p.add_argument(
        "--features",
        default="",
        metavar="F1,F2",
        help="only these features (e.g. path_p,level1,cpu; the default table lists them all)",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the rows as JSON")
    fmt.add_argument("--markdown", action="store_true", help="print the README block (with its markers)")
    fmt.add_argument(
        "--check",
        action="store_true",
        help="import sglang and check every target exists with its leading parameters; exit 2 naming "
        "the first drifted target",
    )
    fmt.add_argument(
        "--write",
        nargs="+",
        metavar="FILE",
        help="replace the patch table block of each FILE (e.g. flashmemory/sglang/plumbing/README.md) in place",
    )
    p.set_defaults(func=run)
