"""The miss monitor's q_lora copy waits for sglang's `q_lora_ready` event (recording torch.cuda stand-in).

In DeepSeek-V4's multi-stream decode (`_forward_prepare_multi_stream`, srt/models/deepseek_v4.py) the indexer stream
forks from the forward stream *before* q_lora is computed there; sglang records `q_lora_ready` after it and hands
the event to the indexer, whose hook copies q_lora into the side band on the indexer stream."""

import dataclasses

import pytest
import torch

from flashmemory.sglang.decode import hooks
from flashmemory.sglang.decode.runtime import RUNTIME
from tests.sglang.decode.test_sideband import HIDDEN, _forward, live  # noqa: F401 (the fixture)
from tests.support.cuda_standin import install

pytestmark = pytest.mark.sglang
RANK = 8


class _Traced(torch.Tensor):
    """q_lora whose reads by `copy_` are logged on the stand-in's current stream."""

    standin = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_" and cls.standin is not None:
            cls.standin.op("read", "q_lora")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_q_lora_copy_waits_for_the_ready_event(live, monkeypatch):  # noqa: F811 (the fixture)
    pool, eng, r2t, _ = live
    monkeypatch.setattr(RUNTIME, "env", dataclasses.replace(eng.env, miss_monitor=True))
    si = install(monkeypatch)
    monkeypatch.setattr(_Traced, "standin", si)
    x, positions = torch.randn(1, HIDDEN), torch.tensor([3 * 256 + 40])
    fb, backend, idx = _forward(pool, ["a"], positions + 1, x, positions)
    fwd, stream_indexer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(fwd):
        stream_indexer.wait_stream(fwd)  # the fork: before q_lora exists
        q_lora = torch.randn(1, RANK).as_subclass(_Traced)
        computed = si.op("write", "q_lora")  # q_lora computed on the forward stream
        ready = fwd.record_event()
        with torch.cuda.stream(stream_indexer):
            hooks.around_forward_c4_indexer(
                lambda *a, **k: None, backend, x, q_lora, idx, fb, enable_multi_stream=True, q_lora_ready=ready
            )
    reads = si.ops("read", "q_lora")
    assert reads, "the side band never copied q_lora"
    assert all(r.stream_name == stream_indexer.name and r.after(computed) for r in reads), reads
    assert torch.equal(RUNTIME.sideband.q_lora[1][:1], q_lora.as_subclass(torch.Tensor))
