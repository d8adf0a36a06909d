"""`eval.live.arms` and `eval.live.stack.pd_config`: what each arm starts, KMAX and the hot buffer per budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashmemory.errors import UserError
from flashmemory.eval.live.arms import LiveArm, parse_arms
from flashmemory.eval.live.stack import StackSettings, pd_config


def test_parse_arms_expands_budgets_and_refuses_bad_names():
    arms = parse_arms("stock,FlashMemory,HiSparse+prefetch", (0.1, 0.2))
    assert [a.key for a in arms] == [
        "stock",
        "FlashMemory@0.1",
        "FlashMemory@0.2",
        "HiSparse+prefetch@0.1",
        "HiSparse+prefetch@0.2",
    ]
    for raw, msg in (("stock,Foo", "unknown Foo"), ("stock,stock", "more than once"), ("", "at least one")):
        with pytest.raises(UserError, match=f"--arms.*{msg}"):
            parse_arms(raw, (0.1,))


def test_kmax_and_hot_buffer_follow_the_budget():
    assert [LiveArm("FlashMemory", b).kmax(4096) for b in (0.05, 0.1, 0.2, 1.0)] == [1, 2, 4, 16]
    assert LiveArm("HiSparse", 0.1).hot_slots(4096, 512) == 512  # never below the top-k
    assert LiveArm("HiSparse", 0.2).hot_slots(4096, 64) == 256  # 4 pages x 64 chunks
    assert LiveArm("HiSparse+prefetch", 0.1).hot_slots(4096, 512) == 576  # a page of hints beside the picks


def _st(**kw):
    return StackSettings(model=Path("/m"), retriever="/r.safetensors", server_env={"SGLANG_W": "32"}, **kw)


def test_pd_config_per_arm():
    stock = pd_config(LiveArm("stock"), _st())
    assert not stock.flashmemory and stock.decode_env["CKPT"] == "" and stock.decode_env["SGLANG_W"] == "32"
    assert stock.prefill_env["CTX_LEN"] == "8192" and stock.prefill_env["SGLANG_W"] == "32"
    fm = pd_config(LiveArm("FlashMemory", 0.2), _st())
    assert fm.flashmemory and fm.transfer_backend == "nixl"
    assert {k: fm.decode_env[k] for k in ("KMAX", "CKPT", "INTERVAL", "THRESH", "LAST_KEEP")} == {
        "KMAX": "4",
        "CKPT": "/r.safetensors",
        "INTERVAL": "16",
        "THRESH": "0.5",
        "LAST_KEEP": "8",
    }
    hs = pd_config(LiveArm("HiSparse", 0.1), _st(index_topk=64))
    assert not hs.flashmemory and hs.transfer_backend == "mooncake" and "--enable-hisparse" in hs.decode_args
    conf = json.loads(hs.decode_args[hs.decode_args.index("--hisparse-config") + 1])
    assert conf == {"top_k": 64, "device_buffer_size": 128} and hs.decode_env["CKPT"] == ""
    assert "LAYERS" not in fm.decode_env  # the launch script's default
    three = pd_config(LiveArm("FlashMemory", 0.1), _st(retriever_layers=(0, 1, 2)))
    assert three.decode_env["LAYERS"] == "0,1,2"  # Level 1 reads the retriever's layers
    pf = pd_config(LiveArm("HiSparse+prefetch", 0.1), _st())
    assert pf.decode_env["SGLANG_FLASHMEMORY_HISPARSE_PREFETCH"] == "1" and pf.decode_env["CKPT"] == "/r.safetensors"
    assert "flashmemory" in pf.decode_env["SGLANG_PLUGINS"].split(",")
