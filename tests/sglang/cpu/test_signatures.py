"""Every patch target exists in the installed sglang with the parameters its row lists, and every drop-in
(`replace` row) takes the same parameters (names, kinds, defaults) as the sglang function it replaces."""

from __future__ import annotations

import inspect

import pytest

from flashmemory.sglang.plumbing.patch_spec import CODE_KINDS, check_signature, target_present, unwrap
from flashmemory.sglang.plumbing.patching import all_patches, load_impl

pytestmark = pytest.mark.sglang
ROWS = [p for p in all_patches() if p.kind in CODE_KINDS]
HOOK_HEAD = {"around": ["original"], "after": ["result"], "before": []}


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("row", ROWS, ids=lambda p: f"{p.feature}:{p.kind}:{p.target.rsplit('.', 2)[-2:]}")
def test_target_exists_with_its_signature(sg, row):
    if not target_present(row):
        pytest.skip(f"{row.target}: optional package not installed")
    theirs = check_signature(row)  # TargetError on a missing target or drift of the leading parameters
    ours = load_impl(row)
    assert callable(ours)
    if row.kind == "replace":
        assert _shape(ours) == _shape(unwrap(theirs)), row.target
    elif row.kind == "attr":  # a builder: replacement = impl(current object)
        assert len(inspect.signature(ours).parameters) == 1 and row.params == (), row.target
    elif row.kind == "step":  # sglang's resolution-hook form: fn(server_args, previous)
        assert list(inspect.signature(ours).parameters) == list(row.params) + ["previous"], row.target
    else:
        # a hook binds the target's arguments by position after its own head argument (`original` / `result`):
        # its named positional parameters must be the target's, in order
        head = HOOK_HEAD[row.kind]
        params = [
            p
            for p in inspect.signature(ours).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        names = [p.name for p in params]
        assert names[: len(head)] == head, (row.target, names)
        target_names = list(inspect.signature(unwrap(theirs)).parameters)
        assert names[len(head) :] == target_names[: len(names) - len(head)], (row.target, names, target_names)
