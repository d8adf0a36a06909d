"""The CPU layer's wiring: gate off = nothing, stubs, and every patch target / signature in the installed sglang."""

import importlib
import sys
import types

import pytest

from flashmemory.sglang.cpu import platform as cpu_platform
from flashmemory.sglang.cpu.stubs import CpuKernelMissing, StubFinder


def test_gate_off_activates_nothing(monkeypatch):
    monkeypatch.delenv("SGLANG_FLASHMEMORY_CPU", raising=False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert cpu_platform.activate() is None
    import os

    assert "SGLANG_USE_CPU_ENGINE" not in os.environ


def test_gate_on_sets_switches_keeps_user_values(monkeypatch):
    monkeypatch.setenv("SGLANG_FLASHMEMORY_CPU", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the user's choice wins
    for k in cpu_platform.CPU_SWITCHES:
        if k != "TRITON_INTERPRET":
            monkeypatch.setenv(k, "")  # recorded first: delenv of an unset name is not undone, and activate()
            monkeypatch.delenv(k)  # would leak sglang's CPU switches into every later test of the session
    calls = []
    monkeypatch.setattr("flashmemory.sglang.cpu.stubs.install_stubs", lambda packages: calls.append(packages))
    assert cpu_platform.activate() == cpu_platform.PLATFORM_CLASS and calls == [("sgl_kernel", "flash_mla")]
    import os

    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1" and os.environ["TRITON_INTERPRET"] == "0"
    monkeypatch.setenv("SGLANG_FLASHMEMORY_CPU", "maybe")
    with pytest.raises(SystemExit, match="SGLANG_FLASHMEMORY_CPU"):
        cpu_platform.activate()


def test_stub_package_real_submodules_and_raising_kernels(tmp_path, monkeypatch):
    pkg = tmp_path / "fm_fake_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    (pkg / "pure.py").write_text("VALUE = 42\n")
    (pkg / "needs_ops.py").write_text("from fm_fake_kernels import common_ops\ncommon_ops.load()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = StubFinder({"fm_fake_kernels": [str(pkg)]})
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    try:
        mod = importlib.import_module("fm_fake_kernels")
        assert importlib.import_module("fm_fake_kernels.pure").VALUE == 42  # pure-Python file: the real one
        from fm_fake_kernels import some_kernel

        with pytest.raises(CpuKernelMissing, match="fm_fake_kernels.some_kernel"):
            some_kernel(1)
        stubbed = importlib.import_module("fm_fake_kernels.needs_ops")  # its import failed: a stub
        assert stubbed.flashmemory_cpu_stub and isinstance(mod, types.ModuleType)
    finally:
        for m in [m for m in sys.modules if m.startswith("fm_fake_kernels")]:
            del sys.modules[m]


def test_cpu_rows_never_share_a_target_with_the_hooks():
    """FlashMemory's own hooks and the CPU patches never share a target (HookRegistry applies a target once)."""
    from flashmemory.sglang.plumbing.patch_spec import CODE_KINDS
    from flashmemory.sglang.plumbing.patching import CPU_FEATURES, select
    from flashmemory.sglang.plumbing.targets import SPECS

    cpu = select(CPU_FEATURES, CODE_KINDS)
    assert len({p.target for p in cpu}) == len(cpu)
    assert not {p.target for p in cpu} & {s.target for s in SPECS}
