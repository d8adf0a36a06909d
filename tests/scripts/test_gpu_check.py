"""scripts/gpu_check.py's retriever case on CPU: the checkpoint it writes passes the plugin's registration check
against the tiny model's config, the case runs at a 10% page budget, and its verdict fails a retriever that
served from anywhere but the GPU or never scored."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import pytest
import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.sglang.retriever_load import load_serving_retriever, place_retriever
from flashmemory.sglang.runtime import Runtime

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_retriever_case_loads_like_the_server_at_a_tenth_of_the_pages(tmp_path):
    gc = _gpu_check()
    assert "ret10" in gc.CASES and gc.CASES.index("ret10") < gc.CASES.index("off")
    (tmp_path / "config.json").write_text(json.dumps(gc.tiny_config()))
    ckpt = gc.write_retriever(str(tmp_path / "retriever.safetensors"), gc.tiny_config())
    e = FlashMemoryEnv.from_environ(gc.case_env("ret10", "", ckpt))
    full = FlashMemoryEnv.from_environ(gc.case_env("full"))
    assert e.retriever_ckpt == ckpt and e.decode_swap_p and e.page_kmax == max(1, full.page_kmax // 10)
    model = load_serving_retriever(e, str(tmp_path))          # the plugin's check: hidden size vs config.json
    assert model.layers == gc.RET_LAYERS and model.dims.hidden == gc.tiny_config()["hidden_size"]
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
    place_retriever(model, "meta")                            # what the adapter does with the pool's device
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_retriever_case_verdicts():
    gc = _gpu_check()
    ref = [[1, 2], [3, 4]]
    good = {"indexer_calls_captured": 8, "reserve_reads_captured": 8, "decode_forwards": 10, "level1_cycles": 3,
            "retriever_device": "cuda:0"}
    assert gc.check_case("ret10", {"tokens": [[5]], "diag": good}, ref) == []      # tokens differ at 10%: reported
    assert "not the GPU" in gc.check_case("ret10", {"tokens": ref, "diag": {**good, "retriever_device": "cpu"}},
                                          ref)[0]
    assert "never scored" in gc.check_case("ret10", {"tokens": ref, "diag": {**good, "level1_cycles": 0}}, ref)[0]
    assert any("did not run" in f for f in gc.check_case("ret10", {"tokens": ref}, ref))


def test_diagnostics_name_the_retrievers_device(tmp_path, monkeypatch):
    rt = Runtime()
    rt.diag_path = str(tmp_path / "diag.json")
    rt.retriever = types.SimpleNamespace(parameters=lambda: iter([torch.zeros(1, device="meta")]))
    rt.write_diagnostics()
    assert json.loads((tmp_path / "diag.json").read_text())["retriever_device"] == "meta"
