"""sglang's own load_plugins() discovers and runs our entry point (subprocess: HookRegistry is global).

Each case runs in a process of its own, forked from one module-scoped process that has imported sglang's plugin
loader and the hook targets' modules and nothing else (`Forker`): no plugin loaded, nothing registered or patched,
as in a fresh process. Importing sglang costs 20-30 s of CPU, paid once for the module instead of once per case.
Needs the entry point installed (`pip install -e .`); skipped otherwise.
"""

import importlib.metadata as md
import json
import os
import selectors
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The forking process: imports sglang's modules (the plugin loader, every hook target's module), then per
# request line {"script", "env", "out", "err"} forks a child that writes its stdout/stderr to those files, adds
# `env` to its environment, runs `script` as __main__ and exits; the parent answers {"rc": exit status}.
FORKER = r"""
import importlib, json, os, sys, traceback
import sglang.srt.plugins
for target in json.loads(os.environ["FM_TARGETS"]):
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
# as in a fresh process: sglang's import loaded the CPU platform's entry point, and no plugin yet
assert not sglang.srt.plugins._plugins_loaded and "flashmemory.sglang.plugin" not in sys.modules
print("READY", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        rc = 0
        try:
            new = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], new), (2, req["err"], new)):
                os.dup2(os.open(path, flags, 0o644), fd)
            os.environ.update(req["env"])
            exec(compile(req["script"], "<case>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
os._exit(0)  # stdin closed: every case has ended (an orderly interpreter exit after sglang's imports takes ~20 s)
"""


class Forker:
    """A running FORKER process (stdin/stdout pipes); `run` sends one case and waits for its exit status."""

    def __init__(self, env: dict[str, str], targets: list[str], timeout_s: float = 240) -> None:
        self.timeout_s = timeout_s
        env = {**env, "FM_TARGETS": json.dumps(targets)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FORKER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._line() == "READY", "the forking process did not start"

    def _line(self) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(self.timeout_s):
            self.proc.kill()
            raise AssertionError(f"the forking process did not answer within {self.timeout_s:.0f} s")
        return self.proc.stdout.readline().strip()

    def run(self, script: str, env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess:
        """`script` in a fresh child with `env` added: its exit status, stdout and stderr."""
        out, err = tmp / "case.out", tmp / "case.err"
        self.proc.stdin.write(json.dumps({"script": script, "env": env, "out": str(out), "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        rc = json.loads(self._line())["rc"]
        return subprocess.CompletedProcess([], rc, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def forker():
    """One FORKER for the module, with the environment each case starts from (no SGLANG_* or FLASHMEMORY*)."""
    pytest.importorskip("sglang")
    from flashmemory.sglang.plumbing.targets import SPECS

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "FLASHMEMORY"))}
    f = Forker({**env, "PYTHONPATH": ROOT}, sorted({s.target for s in SPECS}))
    try:
        yield f
    finally:
        f.close()


SCRIPT = r"""
import json, logging
from flashmemory.sglang.plumbing import targets
from flashmemory.sglang.plumbing.targets import SPECS
from flashmemory.sglang.plumbing.patch_spec import resolve
orig = {s.target: resolve(s.target)[2] for s in SPECS if s.kind != "step"}  # step rows wrap, see below
import os, sglang.srt.plugins as plugins
from flashmemory.sglang import plugin
from flashmemory.sglang.decode.runtime import RUNTIME
for gates in ({}, json.loads(os.environ["FM_GATES_ON"])):  # one process: importing sglang is slow
    os.environ.update(gates)
    plugins._plugins_loaded, RUNTIME.registration = False, None
    try:
        plugins.load_plugins()
        err = None
    except SystemExit as e:
        err = str(e)
    now = {t: resolve(t)[2] for t in orig}
    from sglang.srt.arg_groups import resolution_hooks  # a step row registers a wrapper instead of replacing
    wrapped = [s.target for s in SPECS if s.kind == "step"
               and resolve(s.impl.replace(":", "."))[2] in resolution_hooks._HOOKS.get(s.target.rsplit(".", 1)[1], ())]
    print("RESULT" + json.dumps({"err": err, "state": plugin.state(),
          "patched": sorted(set(t for t in orig if now[t] is not orig[t]) | set(wrapped))}))
"""


def _run(forker, gates_on, tmp: Path):
    p = forker.run(SCRIPT, {"SGLANG_PLUGINS": "flashmemory", "FM_GATES_ON": json.dumps(gates_on)}, tmp)
    lines = [json.loads(ln[6:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(lines) == 2, p.stderr[-3000:]
    return lines


@pytest.fixture(scope="module")
def installed():
    eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "flashmemory"]
    if not eps:
        pytest.skip("flashmemory entry point not installed (run make setup)")


def test_gates_off_patch_nothing_and_on_patch_all(installed, forker, tmp_path):
    off, on = _run(
        forker,
        {
            "SGLANG_FLASHMEMORY_DUMP": "1",
            "SGLANG_FLASHMEMORY_DUMP_ROOT": "/tmp",
            "SGLANG_PATHP_SCORE_RESIDENT": "1",
            "SGLANG_PATHP_CUDAGRAPH": "1",
        },
        tmp_path,
    )
    assert off["err"] is None and off["state"] == {"features": [], "targets": [], "cpu_targets": []}
    assert off["patched"] == []
    assert on["err"] is None, on["err"]
    assert set(on["state"]["features"]) == {"level2", "cudagraph", "dump"}
    # Level 2's four targets plus the launcher's resolution step (wrapped through sglang's resolution hooks)
    assert on["patched"] == sorted(on["state"]["targets"]) and len(on["patched"]) == 5


def test_bad_gate_value_stops_startup(monkeypatch):
    from flashmemory.sglang import plugin
    from flashmemory.sglang.decode.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "registration", None)
    monkeypatch.setenv("SGLANG_PATHP_PAGE_KMAX", "lots")
    monkeypatch.setenv("SGLANG_FLASHMEMORY_DUMP", "1")
    with pytest.raises(plugin.PluginStartupError, match="SGLANG_PATHP_PAGE_KMAX='lots'"):
        plugin.register()
    assert plugin.state() is None  # nothing registered


def test_register_is_idempotent_and_verifies(sg, monkeypatch):
    from flashmemory.sglang import plugin
    from flashmemory.sglang.plumbing.patch_spec import resolve
    from flashmemory.sglang.plumbing.patching import verify
    from flashmemory.sglang.plumbing.targets import SPECS

    spec = SPECS[0]
    orig = {spec.target: resolve(spec.target)[2]}
    bad = verify([spec], orig)  # nothing applied in this process
    assert bad and "is not patched" in bad[0]
    from flashmemory.sglang.decode.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "registration", {"features": (), "targets": []})
    plugin.register()  # already ran: no-op, nothing imported or registered
    assert plugin.state() == {"features": (), "targets": []}


PATHP = r"""
import json, os, sys
sys.path.insert(0, os.environ["FM_TESTS"])
import sglang.srt.plugins as plugins
from flashmemory.sglang.decode import hooks
from flashmemory.sglang import plugin
from flashmemory.sglang.decode.runtime import RUNTIME
from tests.sglang.decode.test_copy_adapter import fake_pool
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


def test_path_p_startup_builds_the_adapter(installed, forker, tmp_path):
    from flashmemory.retriever import save_retriever
    from flashmemory.retriever.model import JointRetriever, RetrieverDims

    ck = save_retriever(
        JointRetriever((1,), RetrieverDims(hidden=16, rank=8, n_heads=2, head_dim=128, rope_dim=64)),
        tmp_path / "tiny.safetensors",
    )
    p = forker.run(
        PATHP,
        {
            "SGLANG_PLUGINS": "flashmemory",
            "FM_TESTS": ROOT,
            "SGLANG_DECODE_SWAP_P": "1",
            "SGLANG_RETRIEVER_INLINE_CKPT": str(ck),
            "SGLANG_RETRIEVER_INLINE_LAYERS": "1",
            "SGLANG_PATHP_DECODE_MAX_CONC": "2",
            "SGLANG_PATHP_RESERVE_PAGES": "4",
            "SGLANG_PATHP_PAGE_KMAX": "2",
            "SGLANG_DSV4_TARGET_CONTEXT": "4096",
        },
        tmp_path,
    )
    lines = [json.loads(ln[6:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, p.stderr[-3000:]
    assert lines[0]["err"] is None, lines[0]["err"]
    # no sglang server args in this process: shrink hooks are applied, the adapter falls back to copy mode
    assert lines[0]["engine"] == "CopyAdapter" and {"path_p", "shrink"} <= set(lines[0]["features"])
    assert lines[0]["alias_patched"] and lines[0]["nixl_patched"]
    # a missing checkpoint: test_bad_checkpoint_stops_startup_at_registration (one sglang import for every bad case)


BADCKPT = r"""
import json, os, sys
import sglang.srt.plugins as plugins
from flashmemory.sglang import plugin
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.plumbing.targets import SPECS
from flashmemory.sglang.plumbing.patch_spec import resolve
orig = {s.target: resolve(s.target)[2] for s in SPECS if s.kind != "step"}  # step rows wrap, see below
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


def test_bad_checkpoint_stops_startup_at_registration(installed, forker, tmp_path):
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
    p = forker.run(BADCKPT, {"SGLANG_PLUGINS": "flashmemory", "FM_CASES": json.dumps(cases)}, tmp_path)
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
