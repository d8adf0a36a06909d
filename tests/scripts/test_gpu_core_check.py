"""scripts/gpu_core_check.py: its CPU quick mode passes with nothing the H200 image lacks, and it fails loudly.

The lent H200 has torch 2.11, numpy, safetensors, triton and transformers on Python 3.12, and no sglang or
serving stack; the script must run there from the repo root with PYTHONPATH=. The subprocess test
runs the quick mode behind an import hook that refuses the serving stack the image lacks (sglang, sglang_router,
nixl, mooncake, fastapi, uvicorn, openai) and packages the core must not need even where an image has them
(pytest, hypothesis, tqdm, yaml, transformers, ...), then checks that every module the run imported is the
standard library, torch (with its own requirements), numpy, or this repository.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_core_check.py"
REFUSED = (
    "sglang",
    "sglang_router",
    "nixl",
    "mooncake",
    "fastapi",
    "uvicorn",
    "openai",
    "pytest",
    "hypothesis",
    "tqdm",
    "yaml",
    "matplotlib",
    "transformers",
    "requests",
    "aiohttp",
    "pandas",
    "scipy",
    "dill",
    "pynvml",
)  # the last two: torch imports them when present, and runs without them
IMAGE = ("torch", "numpy", "safetensors", "triton")
GONE_IN_312 = {"distutils", "imp", "asynchat", "asyncore", "smtpd"}  # stdlib modules Python 3.12 removed

# Runs in a fresh interpreter: the hook goes in before anything is imported, then the script runs as __main__.
WRAPPER = r"""
import importlib.abc, json, runpy, sys
REFUSED = set(sys.argv[1].split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ImportError(f"{name} is not on the H200 image")
        return None
sys.meta_path.insert(0, Refuse())
try:
    import pytest  # installed here: the hook must refuse it, or this test proves nothing
    sys.exit(97)
except ImportError:
    pass
before = set(sys.modules)
MODS = sys.argv[2]
sys.argv = [sys.argv[3]] + sys.argv[4:]
code = 0
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    code = e.code or 0
with open(MODS, "w") as f:
    json.dump(sorted({m.split(".")[0] for m in set(sys.modules) - before}), f)
sys.exit(code)
"""


def _allowed_modules() -> set[str]:
    """Top-level module names of the image's packages and of torch's own (non-extra) requirements."""
    dists = set(IMAGE)
    for req in md.requires("torch") or []:
        if "extra ==" not in req:
            dists.add(re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower().replace("_", "-"))
    mods = {"flashmemory", "gpu_core", "__main__", "__mp_main__"}
    for mod, owners in md.packages_distributions().items():
        if any(o.lower().replace("_", "-") in dists for o in owners):
            mods.add(mod)
    return mods | (set(sys.stdlib_module_names) - GONE_IN_312)


def _stray(imported: list[str]) -> list[str]:
    """Imported top-level names that are neither allowed nor interpreter artefacts (Cython's runtime modules that
    compiled extensions register, the platform's _sysconfigdata)."""
    allowed = _allowed_modules()
    return sorted(
        m for m in imported if m not in allowed and not m.startswith(("_cython_", "cython_runtime", "_sysconfigdata_"))
    )


def _run_wrapped(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    mods = tmp_path / "modules.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", WRAPPER, ",".join(REFUSED), str(mods), str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return p, (json.loads(mods.read_text()) if mods.exists() else [])


def test_quick_cpu_run_passes_without_what_the_h200_image_lacks(tmp_path):
    out = tmp_path / "res"
    p, imported = _run_wrapped(tmp_path, "--device", "cpu", "--quick", "--out", str(out))
    assert p.returncode != 97, "the import hook did not refuse pytest: the test would prove nothing"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["ok"] is True and sorted(doc["checks"]) == ["a", "b", "c", "d"]
    assert all(c["ok"] and not c["failures"] for c in doc["checks"].values())
    assert doc["torch"] == torch.__version__ and doc["quick"] is True
    for line in ("[a] PASS", "[b] PASS", "[c] PASS", "[d] PASS"):
        assert line in p.stdout
    assert "skipped: CUDA graph capture" in p.stdout  # the GPU-only parts say why they did not run
    assert "## (b)" in (out / "results.md").read_text()
    stray = _stray(imported)
    assert not stray, f"the run imported modules the H200 image may lack: {stray}"
    assert "flashmemory" in imported and "gpu_core" in imported  # the list is what the run imported


def _load():
    spec = importlib.util.spec_from_file_location("gpu_core_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--device", "cpu"], "--device cpu needs --quick"),
        (["--device", "cpu", "--quick", "--only", "a,z"], "--only 'a,z'"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, msg, capsys):
    assert _load().main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_device_says_so(capsys):
    assert _load().main([]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_a_byte_that_differs_fails_the_run_with_exit_1(monkeypatch, tmp_path, capsys):
    """One corrupted lookup-table entry on the 'device' engine must fail check (a) and the exit status."""
    mod = _load()
    from gpu_core import offload_check

    real = offload_check._Twin.compare

    def corrupt_then_compare(self):
        self.engines[0].lut.table[0] += 1
        return real(self)

    monkeypatch.setattr(offload_check._Twin, "compare", corrupt_then_compare)
    assert mod.main(["--device", "cpu", "--quick", "--only", "a", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "[a] FAIL" in out and "lut.table differs" in out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["ok"] is False and doc["checks"]["a"]["ok"] is False


def test_level2_verification_catches_a_wrong_cell():
    """The per-step check of Level-2 picks against the engine is not vacuous: a shifted cell is reported."""
    _load()
    from gpu_core import level2_check
    from gpu_core.core import CheckResult, Sizes

    sz = Sizes.tiny()
    bench = level2_check._Bench(sz, torch.device("cpu"), seed=0)
    rows = torch.tensor([0, 1, -1])
    logits = torch.randn(3, sz.l2_max_chunks)
    l2 = level2_check.Level2(bench.eng, max_batch=bench.rows, topk=sz.l2_topk)
    o = l2.mask_topk(logits, rows, sz.l2_topk)
    good = {"mask": level2_check._outs(o)}
    res = CheckResult("b", "t")
    assert level2_check._verify(res, bench, rows, logits, good, 0, 3) and res.ok
    chunks, cells, values = good["mask"]
    assert bool((cells >= 0).any()), "no resident pick to tamper with"
    bad = {"mask": (chunks, torch.where(cells >= 0, cells + 1, cells), values)}
    assert not level2_check._verify(res, bench, rows, logits, bad, 0, 3) and not res.ok


def test_shell_wrapper_runs_the_script_and_copies_results(tmp_path):
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_core_check.sh")]).returncode == 0
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    p = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts/gpu_core_check.sh"),
            "--device",
            "cpu",
            "--quick",
            "--only",
            "d",
            "--out",
            str(tmp_path / "res"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "[d] PASS" in (tmp_path / "gpu_core_check.log").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["checks"]["d"]["ok"]


# torch APIs the script may name: each exists since torch 2.1 at the latest (the H200 image has 2.11, the project
# pins 2.14.1). A new one must be checked against torch 2.11 before it is added here.
STABLE_TORCH = {
    "torch.Generator",
    "torch.Tensor",
    "torch.__version__",
    "torch.arange",
    "torch.bfloat16",
    "torch.bool",
    "torch.cuda.CUDAGraph",
    "torch.cuda.Event",
    "torch.cuda.Stream",
    "torch.cuda.current_stream",
    "torch.cuda.empty_cache",
    "torch.cuda.get_device_name",
    "torch.cuda.get_device_properties",
    "torch.cuda.graph",
    "torch.cuda.is_available",
    "torch.cuda.set_sync_debug_mode",
    "torch.cuda.stream",
    "torch.cuda.synchronize",
    "torch.device",
    "torch.empty",
    "torch.equal",
    "torch.float32",
    "torch.full",
    "torch.index_select",
    "torch.int64",
    "torch.isfinite",
    "torch.manual_seed",
    "torch.mm",
    "torch.no_grad",
    "torch.ones",
    "torch.rand",
    "torch.randint",
    "torch.randn",
    "torch.stack",
    "torch.tensor",
    "torch.uint8",
    "torch.version.cuda",
    "torch.where",
    "torch.zeros",
}


# ... and those the package core the script imports may name besides (also present since torch 2.1).
STABLE_TORCH_CORE = STABLE_TORCH | {
    "nn.Linear",
    "nn.Module",
    "nn.ModuleDict",
    "nn.Parameter",
    "torch.as_tensor",
    "torch.bmm",
    "torch.cat",
    "torch.cuda.set_device",
    "torch.div",
    "torch.dtype",
    "torch.einsum",
    "torch.empty_like",
    "torch.float64",
    "torch.float8_e4m3fn",
    "torch.full_like",
    "torch.iinfo",
    "torch.int16",
    "torch.int32",
    "torch.is_tensor",
    "torch.load",
    "torch.nn.functional.pad",
    "torch.relu",
    "torch.rsqrt",
    "torch.sigmoid",
    "torch.softmax",
    "torch.sort",
    "torch.unique",
    "torch.zeros_like",
    # the disk tier: both exist unchanged since torch 1.10 / 1.0
    "torch.distributed",
    "torch.frombuffer",
}
CORE = ("flashmemory/offload", "flashmemory/residency", "flashmemory/retriever")


def _torch_names(path: Path) -> set[str]:
    """Dotted `torch.x.y` (and `nn.x`) names a source file uses (the longest chain of each attribute access)."""
    used: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            parts, x = [], node
            while isinstance(x, ast.Attribute):
                parts.append(x.attr)
                x = x.value
            if isinstance(x, ast.Name) and x.id in ("torch", "nn"):
                used.add(".".join([x.id, *reversed(parts)]))
    return {u for u in used if not any(v.startswith(u + ".") for v in used)}


def test_script_names_only_long_stable_torch_apis():
    files = [SCRIPT, *sorted((ROOT / "scripts" / "gpu_core").glob("*.py"))]
    used = set().union(*(_torch_names(f) for f in files))
    assert "torch.cuda.graph" in used  # the scan sees the script's names
    assert not used - STABLE_TORCH, f"torch APIs not yet checked against torch 2.11: {sorted(used - STABLE_TORCH)}"


def test_core_the_script_imports_names_only_long_stable_torch_apis():
    """The core must import and run on torch 2.11 too: a torch API not in the list above fails here
    until someone checks it exists in 2.11 (or adds a fallback) and adds it."""
    files = [f for d in CORE for f in sorted((ROOT / d).glob("*.py"))] + [ROOT / "flashmemory" / "atomic.py"]
    used = set().union(*(_torch_names(f) for f in files))
    assert "torch.float8_e4m3fn" in used
    new = sorted(used - STABLE_TORCH_CORE)
    assert not new, f"torch APIs in the package core not yet checked against torch 2.11: {new}"


def test_trace_stops_at_its_time_budget_with_a_final_comparison():
    """With no time left the churn trace stops after one operation, still compares, and reports the ops it ran."""
    _load()
    from gpu_core import offload_check
    from gpu_core.core import CheckResult, Sizes

    res = CheckResult("a", "t")
    offload_check._trace(res, dataclasses.replace(Sizes.tiny(), trace_budget_s=0.0), torch.device("cpu"), seed=0)
    assert res.ok, res.failures
    for mode in ("copy", "shrink"):
        fig = res.figures[f"trace_{mode}"]
        assert fig["ops"] == 1 and fig["ops_planned"] == Sizes.tiny().trace_ops and fig["equal"] is True
