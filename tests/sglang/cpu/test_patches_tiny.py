"""The tiny model's window row: SGLANG_FLASHMEMORY_CPU_SWA_WINDOW sets sglang's SWA_WINDOW in the DeepSeek-V4
backend (applied and verified by the one patch loop, read by the backend's code at call time); unset, the row is
not selected and the backend keeps 128; a bad value is one line naming the variable."""

from __future__ import annotations

import types

import pytest

from flashmemory.env import EnvError, cpu_tiny_geometry
from flashmemory.sglang.cpu.patches_tiny import TINY_PATCHES, swa_window
from flashmemory.sglang.plumbing.patching import SWA_FEATURE, tiny_features

backend = pytest.importorskip("sglang.srt.layers.attention.deepseek_v4_backend")
VAR = "SGLANG_FLASHMEMORY_CPU_SWA_WINDOW"


@pytest.fixture
def fresh(monkeypatch):
    """sglang's constant and the process's applied-patch record put back after the test."""
    from flashmemory.sglang.decode.runtime import RUNTIME

    monkeypatch.setattr(backend, "SWA_WINDOW", backend.SWA_WINDOW)
    monkeypatch.setattr(RUNTIME, "applied_patches", {})
    monkeypatch.setenv("SGLANG_FLASHMEMORY_CPU", "1")
    return monkeypatch


def tail_capacity(max_reqs: int) -> int:
    """sglang's `_prefill_graph_tail_capacity` on a stand-in backend: max_reqs x SWA_WINDOW, read at call time."""
    runner = types.SimpleNamespace(server_args=types.SimpleNamespace(max_running_requests=max_reqs))
    me = types.SimpleNamespace(_bcg_tail_capacity=None, model_runner=runner)
    return backend.DeepseekV4AttnBackend._prefill_graph_tail_capacity(me)


def test_the_row_sets_the_window_the_backend_reads(fresh) -> None:
    from flashmemory.sglang.plumbing import patching

    fresh.setenv(VAR, "32")
    assert tail_capacity(4) == 4 * 128
    rows = patching.select(patching.cpu_features(cpu_tiny_geometry()))
    row = next(p for p in rows if p.feature == SWA_FEATURE)
    assert patching.apply([row]) == [row.target]
    assert backend.SWA_WINDOW == 32 and tail_capacity(4) == 4 * 32
    assert patching.apply([row]) == [row.target] and backend.SWA_WINDOW == 32  # once per process


def test_gate_off_selects_no_row_and_the_backend_keeps_128(fresh) -> None:
    from flashmemory.sglang.plumbing import patching

    fresh.delenv(VAR, raising=False)
    assert cpu_tiny_geometry().swa_window == 0 and tiny_features(cpu_tiny_geometry()) == ()
    assert patching.cpu_features(cpu_tiny_geometry()) == patching.CPU_FEATURES
    assert not [p for p in patching.select(patching.CPU_FEATURES) if p.feature == SWA_FEATURE]
    assert backend.SWA_WINDOW == 128 and tail_capacity(2) == 256


def test_the_builder_refuses_another_sglang_constant_and_logs_the_change(fresh, capsys) -> None:
    fresh.setenv(VAR, "32")
    with pytest.raises(ValueError, match="expected sglang 0.5.23's 128"):
        swa_window(64)
    assert swa_window(128) == 32
    assert "sliding window SWA_WINDOW 128 -> 32" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["48", "0x", "256", "-32"])
def test_a_bad_window_is_one_line_naming_the_variable(raw: str) -> None:
    with pytest.raises(EnvError, match=VAR):
        cpu_tiny_geometry({VAR: raw, "SGLANG_FLASHMEMORY_CPU": "1"})


def test_the_window_without_the_cpu_layer_is_refused() -> None:
    with pytest.raises(EnvError, match=f"{VAR}=32 is a row of the CPU layer: it needs SGLANG_FLASHMEMORY_CPU=1"):
        cpu_tiny_geometry({VAR: "32"})


def test_the_row_targets_the_module_constant() -> None:
    (row,) = TINY_PATCHES
    assert row.kind == "attr" and row.target.endswith("deepseek_v4_backend.SWA_WINDOW")
    on = {"SGLANG_FLASHMEMORY_CPU": "1"}
    assert cpu_tiny_geometry({VAR: "32", **on}).swa_window == 32 and cpu_tiny_geometry(on).swa_window == 0
