"""`configure_dsv4_fp8`: sglang's CPU fp8 KV check is skipped for the DSv4 pool on the configuring thread only,
through the platform view its `attr` row puts on kv_cache_configurator."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from flashmemory.sglang.cpu.patches_runtime import Dsv4Fp8PlatformView, configure_dsv4_fp8, dsv4_fp8_platform_view

kcc = pytest.importorskip("sglang.srt.mem_cache.kv_cache_configurator")


class CpuPlatform:
    name = "cpu-for-test"

    def is_cpu(self) -> bool:
        return True


def configurator(arch: str, dtype: torch.dtype) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=[arch])), kv_cache_dtype=dtype
    )


def test_only_the_configuring_thread_sees_a_non_cpu_platform(monkeypatch) -> None:
    monkeypatch.setattr(kcc, "current_platform", dsv4_fp8_platform_view(CpuPlatform()))
    seen: dict[str, object] = {}

    def original(self, *, pre_model_load_memory: int) -> str:
        seen["inside"] = kcc.current_platform.is_cpu()
        seen["name"] = kcc.current_platform.name  # everything else delegates
        other = threading.Thread(target=lambda: seen.__setitem__("other", kcc.current_platform.is_cpu()))
        other.start()
        other.join()
        return "configured"

    out = configure_dsv4_fp8(
        original, configurator("DeepseekV4ForCausalLM", torch.float8_e4m3fn), pre_model_load_memory=0
    )
    assert out == "configured"
    assert seen == {"inside": False, "name": "cpu-for-test", "other": True}
    assert kcc.current_platform.is_cpu()  # after the call, on this thread too
    view = kcc.current_platform
    assert isinstance(view, Dsv4Fp8PlatformView)
    configure_dsv4_fp8(
        lambda self, **kw: None, configurator("DeepseekV4ForCausalLM", torch.float8_e4m3fn), pre_model_load_memory=0
    )
    assert kcc.current_platform is view and dsv4_fp8_platform_view(view) is view  # one view, never stacked


@pytest.mark.parametrize(
    "arch,dtype", [("DeepseekV4ForCausalLM", torch.bfloat16), ("LlamaForCausalLM", torch.float8_e4m3fn)]
)
def test_other_models_and_dtypes_keep_the_check(monkeypatch, arch, dtype) -> None:
    monkeypatch.setattr(kcc, "current_platform", dsv4_fp8_platform_view(CpuPlatform()))
    seen = []
    configure_dsv4_fp8(
        lambda self, **kw: seen.append(kcc.current_platform.is_cpu()),
        configurator(arch, dtype),
        pre_model_load_memory=0,
    )
    assert seen == [True]


def test_os_threads_counts_a_started_thread() -> None:
    from flashmemory.sglang.cpu.patches_runtime import os_threads

    before, stop = os_threads(), threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert os_threads() == before + 1
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("threads,method", [(1, "fork"), (3, "spawn")])
def test_children_fork_only_from_a_single_threaded_launcher(monkeypatch, caplog, threads, method) -> None:
    import multiprocessing

    import flashmemory.sglang.cpu.patches_runtime as rt

    old = multiprocessing.get_start_method(allow_none=True)
    monkeypatch.setattr(rt, "os_threads", lambda: threads)
    try:
        multiprocessing.set_start_method("spawn", force=True)  # what sglang's _set_envs_and_config just did
        with caplog.at_level("INFO", logger=rt.__name__):
            rt.fork_children(None, object())
        assert multiprocessing.get_start_method() == method
        assert ("start by fork" if method == "fork" else f"runs {threads} threads") in caplog.text
    finally:
        multiprocessing.set_start_method(old, force=True)


def test_without_the_view_the_check_runs_as_shipped(monkeypatch) -> None:
    """Only the `attr` row changes the module's platform: the hook alone installs nothing."""
    platform = CpuPlatform()
    monkeypatch.setattr(kcc, "current_platform", platform)
    seen = []
    configure_dsv4_fp8(
        lambda self, **kw: seen.append(kcc.current_platform.is_cpu()),
        configurator("DeepseekV4ForCausalLM", torch.float8_e4m3fn),
        pre_model_load_memory=0,
    )
    assert seen == [True] and kcc.current_platform is platform


def test_the_attr_row_installs_the_view_on_that_module_only(sg, monkeypatch) -> None:
    """The row goes through the apply-and-verify loop: kv_cache_configurator's platform becomes the view, the
    platform module's own `current_platform` (and every other importer's copy) stays sglang's object."""
    import sglang.srt.platforms as platforms

    from flashmemory.sglang.cpu.patches_runtime import RUNTIME_PATCHES
    from flashmemory.sglang.plumbing import patching

    row = next(p for p in RUNTIME_PATCHES if p.kind == "attr")
    monkeypatch.setattr(kcc, "current_platform", kcc.current_platform)  # put back after the test
    from flashmemory.sglang.decode.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "applied_patches", {})
    before = kcc.current_platform
    assert patching.apply([row]) == [row.target]
    assert isinstance(kcc.current_platform, Dsv4Fp8PlatformView) and kcc.current_platform.platform is before
    assert platforms.current_platform is before
    view = kcc.current_platform
    assert patching.apply([row]) == [row.target] and kcc.current_platform is view  # once per process
