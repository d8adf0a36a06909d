"""sglang's own load_plugins() discovers and runs our entry point (subprocess: HookRegistry is global).

Needs the entry point installed (`pip install -e .`); skipped otherwise.
"""

import importlib.metadata as md
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = r"""
import json, logging
from flashmemory.sglang import targets
from flashmemory.sglang.targets import SPECS
from flashmemory.sglang.patch_spec import resolve
orig = {s.target: resolve(s.target)[2] for s in SPECS}
import os, sglang.srt.plugins as plugins
from flashmemory.sglang import plugin
from flashmemory.sglang.runtime import RUNTIME
for gates in ({}, json.loads(os.environ["FM_GATES_ON"])):  # one process: importing sglang is slow
    os.environ.update(gates)
    plugins._plugins_loaded, RUNTIME.registration = False, None
    try:
        plugins.load_plugins()
        err = None
    except SystemExit as e:
        err = str(e)
    now = {s.target: resolve(s.target)[2] for s in SPECS}
    print("RESULT" + json.dumps({"err": err, "state": plugin.state(),
          "patched": sorted(t for t in orig if now[t] is not orig[t])}))
"""


def _run(gates_on):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "FLASHMEMORY"))}
    env.update({"PYTHONPATH": ROOT, "SGLANG_PLUGINS": "flashmemory", "FM_GATES_ON": json.dumps(gates_on)})
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    lines = [json.loads(ln[6:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(lines) == 2, p.stderr[-3000:]
    return lines


@pytest.fixture(scope="module")
def installed():
    eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "flashmemory"]
    if not eps:
        pytest.skip("flashmemory entry point not installed (run make setup)")


def test_gates_off_patch_nothing_and_on_patch_all(installed):
    off, on = _run(
        {
            "SGLANG_FLASHMEMORY_DUMP": "1",
            "SGLANG_FLASHMEMORY_DUMP_ROOT": "/tmp",
            "SGLANG_PATHP_SCORE_RESIDENT": "1",
            "SGLANG_PATHP_CUDAGRAPH": "1",
        }
    )
    assert off["err"] is None and off["state"] == {"features": [], "targets": [], "cpu_targets": []}
    assert off["patched"] == []
    assert on["err"] is None, on["err"]
    assert set(on["state"]["features"]) == {"level2", "cudagraph", "dump"}
    assert on["patched"] == on["state"]["targets"] and len(on["patched"]) == 4


def test_bad_gate_value_stops_startup(monkeypatch):
    from flashmemory.sglang import plugin
    from flashmemory.sglang.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "registration", None)
    monkeypatch.setenv("SGLANG_PATHP_PAGE_KMAX", "lots")
    monkeypatch.setenv("SGLANG_FLASHMEMORY_DUMP", "1")
    with pytest.raises(plugin.PluginStartupError, match="SGLANG_PATHP_PAGE_KMAX='lots'"):
        plugin.register()
    assert plugin.state() is None  # nothing registered


def test_register_is_idempotent_and_verifies(sg, monkeypatch):
    from flashmemory.sglang import plugin
    from flashmemory.sglang.patch_spec import resolve
    from flashmemory.sglang.patching import verify
    from flashmemory.sglang.targets import SPECS

    spec = SPECS[0]
    orig = {spec.target: resolve(spec.target)[2]}
    bad = verify([spec], orig)  # nothing applied in this process
    assert bad and "is not patched" in bad[0]
    from flashmemory.sglang.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "registration", {"features": (), "targets": []})
    plugin.register()  # already ran: no-op, nothing imported or registered
    assert plugin.state() == {"features": (), "targets": []}


PATHP = r"""
import json, os, sys
sys.path.insert(0, os.environ["FM_TESTS"])
import sglang.srt.plugins as plugins
from flashmemory.sglang import hooks, plugin
from flashmemory.sglang.runtime import RUNTIME
from test_engine_adapter import fake_pool
from sglang.srt.layers.attention.dsv4.compressor_v2 import CompressorBackendMixin as C
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
before = (C.forward_indexer_compressor, NixlKVManager.__init__)
try:
    plugins.load_plugins()
    hooks.after_pool_init(None, fake_pool())   # what the pool __init__ hook does when sglang builds the pool
    out = {"err": None, "engine": type(RUNTIME.engine).__name__, "features": list(plugin.state()["features"]),
           "alias_patched": C.forward_indexer_compressor is not before[0],
           "nixl_patched": NixlKVManager.__init__ is not before[1]}
except SystemExit as e:
    out = {"err": str(e)}
print("RESULT" + json.dumps(out))
"""


def test_path_p_startup_builds_the_adapter(installed, tmp_path):
    from flashmemory.retriever import save_retriever
    from flashmemory.retriever.model import JointRetriever, RetrieverDims

    ck = save_retriever(
        JointRetriever((1,), RetrieverDims(hidden=16, rank=8, n_heads=2, head_dim=128, rope_dim=64)),
        tmp_path / "tiny.safetensors",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "FLASHMEMORY"))}
    env.update(
        {
            "PYTHONPATH": ROOT,
            "SGLANG_PLUGINS": "flashmemory",
            "FM_TESTS": os.path.dirname(__file__),
            "SGLANG_DECODE_SWAP_P": "1",
            "SGLANG_RETRIEVER_INLINE_CKPT": str(ck),
            "SGLANG_RETRIEVER_INLINE_LAYERS": "1",
            "SGLANG_PATHP_DECODE_MAX_CONC": "2",
            "SGLANG_PATHP_RESERVE_PAGES": "4",
            "SGLANG_PATHP_PAGE_KMAX": "2",
            "SGLANG_DSV4_TARGET_CONTEXT": "4096",
        }
    )
    p = subprocess.run([sys.executable, "-c", PATHP], env=env, capture_output=True, text=True, timeout=240)
    lines = [json.loads(ln[6:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, p.stderr[-3000:]
    assert lines[0]["err"] is None, lines[0]["err"]
    # no sglang server args in this process: shrink hooks are applied, the adapter falls back to copy mode
    assert lines[0]["engine"] == "SGLangOffload" and {"path_p", "shrink"} <= set(lines[0]["features"])
    assert lines[0]["alias_patched"] and lines[0]["nixl_patched"]
    # a missing checkpoint: test_bad_checkpoint_stops_startup_at_registration (one sglang import for every bad case)


BADCKPT = r"""
import json, os, sys
import sglang.srt.plugins as plugins
from flashmemory.sglang import plugin
from flashmemory.sglang.runtime import RUNTIME
from flashmemory.sglang.targets import SPECS
from flashmemory.sglang.patch_spec import resolve
orig = {s.target: resolve(s.target)[2] for s in SPECS}
for case in json.loads(os.environ["FM_CASES"]):
    os.environ.update(case["env"])
    sys.argv = ["sglang.launch_server", *case["argv"]]
    plugins._plugins_loaded, RUNTIME.registration = False, None
    try:
        plugins.load_plugins()   # swallows exceptions, so only a SystemExit stops it
        err = None
    except SystemExit as e:
        err = str(e)
    print("RESULT" + json.dumps({"err": err, "patched": [t for t in orig if resolve(t)[2] is not orig[t]]}))
"""


def test_bad_checkpoint_stops_startup_at_registration(installed, tmp_path):
    """Missing, truncated, NaN, wrong-layer and wrong-hidden-size checkpoints stop load_plugins() with one line, before
    any hook is applied (so before sglang builds the pool or loads the model)."""
    from safetensors.torch import load_file, save_file

    from flashmemory.retriever import save_retriever
    from flashmemory.retriever.model import JointRetriever, RetrieverDims

    ck = save_retriever(
        JointRetriever((1,), RetrieverDims(hidden=16, rank=8, n_heads=2, head_dim=128, rope_dim=64)),
        tmp_path / "tiny.safetensors",
    )
    sd = load_file(str(ck))
    sd["retrievers.l1.wq_a.weight"][0, 0] = float("inf")
    save_file(sd, str(tmp_path / "inf.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes(ck.read_bytes()[:100])
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    base = {"SGLANG_DECODE_SWAP_P": "1", "SGLANG_RETRIEVER_INLINE_LAYERS": "1"}
    cases = [
        {"env": base | {"SGLANG_RETRIEVER_INLINE_CKPT": str(tmp_path / "missing.safetensors")}, "argv": []},
        {"env": base | {"SGLANG_RETRIEVER_INLINE_CKPT": str(tmp_path / "cut.safetensors")}, "argv": []},
        {"env": base | {"SGLANG_RETRIEVER_INLINE_CKPT": str(tmp_path / "inf.safetensors")}, "argv": []},
        {"env": base | {"SGLANG_RETRIEVER_INLINE_CKPT": str(ck), "SGLANG_RETRIEVER_INLINE_LAYERS": "2"}, "argv": []},
        {"env": base | {"SGLANG_RETRIEVER_INLINE_CKPT": str(ck)}, "argv": ["--model-path", str(tmp_path / "model")]},
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "FLASHMEMORY"))}
    env.update({"PYTHONPATH": ROOT, "SGLANG_PLUGINS": "flashmemory", "FM_CASES": json.dumps(cases)})
    p = subprocess.run([sys.executable, "-c", BADCKPT], env=env, capture_output=True, text=True, timeout=240)
    res = [json.loads(ln[6:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(res) == len(cases), p.stderr[-3000:]
    want = [
        r"missing\.safetensors",
        r"cut\.safetensors: unreadable safetensors file",
        r"inf\.safetensors: retrievers\.l1\.wq_a\.weight holds 1 non-finite",
        r"layer\(s\) \[2\] not in checkpoint",
        r"hidden size 16 does not match the served model's hidden_size 4096",
    ]
    import re

    for r, pat in zip(res, want):
        assert r["err"] and r["err"].startswith("FlashMemory startup error: SGLANG_RETRIEVER_INLINE_CKPT="), r
        assert re.search(pat, r["err"]) and "\n" not in r["err"], r["err"]
        assert r["patched"] == []


def test_announce_reaches_the_server_log_before_logging_is_configured(capsys, caplog, monkeypatch):
    """sglang's launcher loads plugins while its root logger is at WARNING: `register`'s line goes to stderr."""
    import logging

    from flashmemory.sglang import plugin

    monkeypatch.setattr(plugin.logger, "isEnabledFor", lambda level: level >= logging.WARNING)
    plugin.announce("FlashMemory: all gates off")
    assert capsys.readouterr().err == "FlashMemory: all gates off\n" and not caplog.records
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        plugin.announce("FlashMemory: active features: level2")
    assert capsys.readouterr().err == "" and [r.getMessage() for r in caplog.records] == [
        "FlashMemory: active features: level2"
    ]
