"""scripts/gpu_check_cases.py (the cases of scripts/gpu_check.py) on CPU: the retriever case's checkpoint passes
the plugin's registration check against the tiny model's config, the case runs at a 10% page budget, and its
verdict fails a retriever that served from anywhere but the GPU or never scored."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.sglang.decode.retriever_load import load_serving_retriever, place_retriever
from flashmemory.sglang.decode.runtime import Runtime

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_cases", ROOT / "scripts" / "gpu_check_cases.py")
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
    model = load_serving_retriever(e, str(tmp_path))  # the plugin's check: hidden size vs config.json
    assert model.layers == gc.RET_LAYERS and model.dims.hidden == gc.tiny_config()["hidden_size"]
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
    place_retriever(model, "meta")  # what the adapter does with the pool's device
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_retriever_case_verdicts():
    gc = _gpu_check()
    ref = [[1, 2], [3, 4]]
    good = {
        "indexer_calls_captured": 8,
        "reserve_reads_captured": 8,
        "decode_forwards": 10,
        "level1_cycles": 3,
        "retriever_device": "cuda:0",
    }
    assert gc.check_case("ret10", {"tokens": [[5]], "diag": good}, ref) == []  # tokens differ at 10%: reported
    assert "not the GPU" in gc.check_case("ret10", {"tokens": ref, "diag": {**good, "retriever_device": "cpu"}}, ref)[0]
    assert "never scored" in gc.check_case("ret10", {"tokens": ref, "diag": {**good, "level1_cycles": 0}}, ref)[0]
    assert any("did not run" in f for f in gc.check_case("ret10", {"tokens": ref}, ref))


def test_diagnostics_name_the_retrievers_device(tmp_path, monkeypatch):
    rt = Runtime()
    rt.diag_path = str(tmp_path / "diag.json")
    rt.retriever = types.SimpleNamespace(parameters=lambda: iter([torch.zeros(1, device="meta")]))
    rt.write_diagnostics()
    assert json.loads((tmp_path / "diag.json").read_text())["retriever_device"] == "meta"


def test_tp2_cases_check_tokens_and_rank_agreement():
    """TP 2: tp2full must give tp2stock's tokens; tp2full and tp2ret10 must find rank 1's diagnostics and equal
    Level-1 counters on both ranks; the cases run at tp_size 2 with the retriever and the 10% budget."""
    gc = _gpu_check()
    ref = [[1, 2], [3, 4]]
    d0 = {
        "indexer_calls_captured": 8,
        "reserve_reads_captured": 8,
        "decode_forwards": 10,
        "level1_cycles": 3,
        "retriever_device": "cuda:0",
        "recall_pages": 12,
        "recall_bytes": 4096,
        "resident_fraction": 0.1,
    }
    assert gc.check_case("tp2full", {"tokens": ref, "diag": d0, "diag_rank1": dict(d0)}, ref) == []
    assert gc.check_case("tp2ret10", {"tokens": [[9]], "diag": d0, "diag_rank1": dict(d0)}, ref) == []
    assert any(
        "differ from tp2stock" in f
        for f in gc.check_case("tp2full", {"tokens": [[9]], "diag": d0, "diag_rank1": dict(d0)}, ref)
    )
    late = gc.check_case("tp2ret10", {"tokens": ref, "diag": d0, "diag_rank1": {**d0, "level1_cycles": 2}}, ref)
    assert any("disagree" in f and "level1_cycles" in f for f in late)
    assert any("rank 1" in f for f in gc.check_case("tp2full", {"tokens": ref, "diag": d0}, ref))
    assert gc.engine_kwargs("m", 1, tp=2)["tp_size"] == 2 and gc.engine_kwargs("m", 1)["tp_size"] == 1
    env = gc.case_env("tp2ret10", "s", "ckpt.safetensors")
    assert env["SGLANG_RETRIEVER_INLINE_CKPT"] == "ckpt.safetensors"
    assert env["SGLANG_PATHP_PAGE_KMAX"] == gc.case_env("ret10", "s", "c")["SGLANG_PATHP_PAGE_KMAX"]
    assert gc.case_env("tp2stock")["SGLANG_PLUGINS"] == "none"
    assert gc.REF_OF["tp2full"] == "tp2stock" and gc.REF_OF["dshrink"] == "dstock"
