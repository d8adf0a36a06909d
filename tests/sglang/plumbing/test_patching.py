"""The one apply-and-verify loop (`flashmemory.sglang.plumbing.patching`): selection, the wrapping point, optional rows,
env rows, and a failure as one startup line. In-process tests use targets of a throwaway module, never sglang's."""

from __future__ import annotations

import sys
import types

import pytest

from flashmemory.sglang.plumbing import patching
from flashmemory.sglang.plumbing.patch_spec import KINDS, Patch

MOD = "fm_patching_target"


@pytest.fixture
def target_module(monkeypatch):
    """A module `fm_patching_target` with `f(x, y)` and our hook `around_f`, and a clean applied-set."""
    mod = types.ModuleType(MOD)

    def f(x: int, y: int) -> int:
        return x + y

    def around_f(original, x: int, y: int) -> int:
        return 10 * original(x, y)

    mod.f, mod.around_f = f, around_f
    monkeypatch.setitem(sys.modules, MOD, mod)
    from flashmemory.sglang.decode.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "applied_patches", {})
    yield mod
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry._hooks.pop(f"{MOD}.f", None)
    HookRegistry._patched.discard(f"{MOD}.f")


def test_every_row_is_well_formed():
    rows = patching.all_patches()
    assert rows and all(isinstance(p, Patch) and p.kind in KINDS and p.why for p in rows)
    import re

    code = [p for p in rows if p.kind not in ("env", "import_stub")]
    assert all(re.search(r"\.py:\d+", p.why) for p in code), [
        p.target for p in code if not re.search(r"\.py:\d+", p.why)
    ]
    with pytest.raises(ValueError, match="kind"):
        Patch("x", "a.b", "monkey", "m:f", (), "why")
    with pytest.raises(ValueError, match="why"):
        Patch("x", "a.b", "around", "m:f", (), "")


def test_select_dedups_a_shared_hook_and_filters_kinds():
    shared = [p for p in patching.select(("path_p", "level1")) if p.target.endswith("ModelRunner.forward")]
    assert sorted(p.kind for p in shared) == ["after", "before"]
    assert {p.kind for p in patching.select(("cpu",), patching.PLATFORM_KINDS)} == {"env", "import_stub"}


def test_apply_hands_sglang_the_impl_once_and_verifies(sg, target_module):
    from sglang.srt.plugins.hook_registry import HookRegistry

    row = Patch("t", f"{MOD}.f", "around", f"{MOD}:around_f", ("x", "y"), "test.py:1")
    assert patching.apply([row]) == [f"{MOD}.f"]
    assert target_module.f(1, 2) == 30
    assert [h for _, h, _ in HookRegistry._hooks[f"{MOD}.f"]] == [target_module.around_f]  # the impl itself
    assert patching.apply([row]) == [f"{MOD}.f"] and target_module.f(1, 2) == 30  # once per process


def test_drift_and_a_missing_impl_are_one_startup_line(sg, target_module):
    drift = Patch("t", f"{MOD}.f", "around", f"{MOD}:around_f", ("x", "z"), "test.py:1")
    with pytest.raises(patching.StartupError, match=r"^FlashMemory startup error: .*signature drift\); ctx$"):
        patching.apply([drift], context="; ctx")
    gone = Patch("t", f"{MOD}.f", "around", f"{MOD}:nope", ("x", "y"), "test.py:1")
    with pytest.raises(patching.StartupError, match="cannot load fm_patching_target:nope"):
        patching.apply([gone])
    assert target_module.f(1, 2) == 3  # nothing applied


def test_a_hook_that_does_not_apply_stops_startup(sg, target_module, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "apply_hooks", classmethod(lambda cls: None))  # it only logs failures
    row = Patch("t", f"{MOD}.f", "around", f"{MOD}:around_f", ("x", "y"), "test.py:1")
    with pytest.raises(patching.StartupError, match="did not apply: fm_patching_target.f is not patched"):
        patching.apply([row])


def test_optional_rows_of_absent_packages_are_skipped(target_module):
    row = Patch(
        "t", "fm_no_such_package.Agent.__init__", "after", f"{MOD}:around_f", ("self",), "x.py:1", optional=True
    )
    assert patching.apply([row]) == []


def test_env_rows_keep_the_users_value():
    env = {"B": "mine"}
    rows = [Patch("cpu", "A", "env", "1", (), "a.py:1"), Patch("cpu", "B", "env", "0", (), "b.py:1")]
    patching.apply(rows, environ=env)
    assert env == {"A": "1", "B": "mine"}


def test_the_readme_table_is_the_generated_one():
    """flashmemory/sglang/plumbing/README.md holds exactly `flashmemory patches --markdown` (regenerate with
    `flashmemory patches --write flashmemory/sglang/plumbing/README.md`)."""
    from pathlib import Path

    from flashmemory.sglang.plumbing import patches_cli

    text = (Path(__file__).resolve().parents[3] / "flashmemory" / "sglang" / "plumbing" / "README.md").read_text()
    block = text[text.index(patches_cli.BEGIN) : text.index(patches_cli.END) + len(patches_cli.END)]
    assert block == patches_cli.as_markdown(patches_cli.rows())


def test_patches_command(tmp_path, capsys, monkeypatch):
    import json

    from flashmemory.cli import main

    assert main(["patches", "--features", "cpu_pd,path_i", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {r["feature"] for r in got} == {"cpu_pd", "path_i"} and all(r["why"] for r in got)
    assert main(["patches", "--features", "nope"]) == 2
    assert "--features: unknown feature(s) ['nope']" in capsys.readouterr().err
    readme = tmp_path / "R.md"
    readme.write_text(
        "head\n<!-- BEGIN PATCH TABLE (flashmemory patches --markdown) -->\nold\n<!-- END PATCH TABLE -->\ntail\n"
    )
    assert main(["patches", "--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("head\n<!-- BEGIN") and text.endswith("-->\ntail\n") and "| shrink | around |" in text
    (tmp_path / "no.md").write_text("no markers\n")
    assert main(["patches", "--write", str(tmp_path / "no.md")]) == 2
    assert "no patch table markers" in capsys.readouterr().err


def test_check_names_the_first_drifted_target(sg, target_module, monkeypatch, capsys):
    from flashmemory.cli import main

    rows = (
        Patch("t", f"{MOD}.f", "around", f"{MOD}:around_f", ("x", "y"), "test.py:1"),
        Patch("t", f"{MOD}.f", "around", f"{MOD}:around_f", ("x", "renamed"), "test.py:2"),
        Patch("t", f"{MOD}.gone", "around", f"{MOD}:around_f", ("x",), "test.py:3"),
    )
    monkeypatch.setattr(patching, "all_patches", lambda: rows)
    assert main(["patches", "--check"]) == 2
    err = capsys.readouterr().err
    assert "fm_patching_target.f: expected leading parameters ['x', 'renamed']" in err and "gone" not in err
    monkeypatch.setattr(patching, "all_patches", lambda: rows[:1])
    assert main(["patches", "--check"]) == 0
    assert "ok: 1 code targets" in capsys.readouterr().out


def test_an_attr_row_replaces_its_object_once_and_a_refusal_is_one_line(target_module):
    shipped = object()
    target_module.platform = shipped
    target_module.wrap = lambda current: ("view", current)
    target_module.refuse = lambda current: (_ for _ in ()).throw(RuntimeError("this release is not supported"))
    row = Patch("t", f"{MOD}.platform", "attr", f"{MOD}:wrap", (), "test.py:1")
    assert patching.apply([row]) == [f"{MOD}.platform"]
    assert target_module.platform == ("view", shipped)
    assert patching.apply([row]) == [f"{MOD}.platform"] and target_module.platform == ("view", shipped)  # once
    bad = Patch("t", f"{MOD}.platform", "attr", f"{MOD}:refuse", (), "test.py:2")
    with pytest.raises(
        patching.StartupError, match=rf"^FlashMemory startup error: {MOD}.platform: this release is not supported$"
    ):
        patching.apply([bad])
