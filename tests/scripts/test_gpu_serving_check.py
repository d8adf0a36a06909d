"""scripts/gpu_serving_check.py: its CPU mode runs the serving adapter's hook sequence with nothing the lent GPU
image lacks (no sglang, no prometheus_client), and its checks can fail.

The run goes through the same import hook as scripts/gpu_core_check.py's test (tests/scripts/test_gpu_core_check.py),
which also refuses prometheus_client here (the plugin exports metrics with it when present; the image has none)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.scripts.test_gpu_core_check import REFUSED, WRAPPER, _stray

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_serving_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_serving_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_cpu_run_passes_without_sglang(tmp_path):
    out, mods = tmp_path / "res", tmp_path / "modules.json"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    p = subprocess.run(
        [sys.executable, "-c", WRAPPER, ",".join((*REFUSED, "prometheus_client")), str(mods), str(SCRIPT)]
        + ["--device", "cpu", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode != 97, "the import hook did not refuse pytest: the test would prove nothing"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[steps] PASS" in p.stdout and "[graph] PASS" in p.stdout and "CUDA graphs need CUDA" in p.stdout
    doc = json.loads((out / "results.json").read_text())
    steps = doc["checks"]["steps"]["figures"]
    assert doc["ok"] and doc["torch"] == torch.__version__
    assert steps["level1_cycles"] > 0 and steps["resident_picks_checked"] > 0
    assert steps["resident_picks_with_wrong_bytes"] == 0 and steps["steps_by_kind"]["join/leave"] >= 2
    assert "## steps" in (out / "results.md").read_text()
    imported = json.loads(mods.read_text())
    assert "flashmemory" in imported and "sglang" not in imported
    stray = [m for m in _stray(imported) if m != "gpu_serving"]  # scripts/gpu_serving: the script's own
    assert "gpu_serving" in imported and not stray, stray


def test_wrong_reserve_bytes_fail_the_steps_check(monkeypatch):
    """A cell map that sends picks to the wrong cells is caught by the byte check (the check can fail)."""
    mod = _load()
    real = mod.Decode.step

    def step(self, counter=None):
        out = real(self, counter)
        res = self.adapter.reserve_kv(0)
        res.view(-1)[: res.numel() // 2] ^= 0xFF  # corrupt half of layer 0's reserve
        return out

    monkeypatch.setattr(mod.Decode, "step", step)
    r = mod.check_steps(mod.Sizes.pick(torch.device("cpu")), torch.device("cpu"), 0)
    assert not r.ok and any("differ from the pool" in f for f in r.failures), r.failures
