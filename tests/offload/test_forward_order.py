"""The core's stream handling with the recording torch.cuda stand-in (tests/support): the forward stream is the one
handed in at each step, never the one current at construction; a recall from another thread writes its tables
only between two forwards; the Level-1 worker thread sets the engine's device before any other CUDA call."""

from __future__ import annotations

import threading

import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, RecallRequest
from flashmemory.offload.lut import ChunkLUT
from flashmemory.residency.level1 import Level1, Level1Config
from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy
from tests.support.cuda_standin import install

LAYOUT = OffloadLayout.tiny(n_layers=2, page_chunks=4, target_layers=(1,))


def _engine() -> OffloadEngine:
    eng = OffloadEngine(
        LAYOUT, EngineConfig(max_rows=2, max_chunks=32, recall_blocks=8, decode_pages=2, max_resident_pages=4)
    )
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, (2, 20, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = torch.randint(0, 256, (2, 20, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g)
    eng.admit(0, kv, ix)
    return eng


def _log_lut_writes(monkeypatch, si) -> None:
    for name in ("set_range", "set", "clear_page", "clear_pages", "set_pages"):
        orig = getattr(ChunkLUT, name)
        monkeypatch.setattr(
            ChunkLUT, name, lambda self, *a, _o=orig, **k: (si.op("write", "lut"), _o(self, *a, **k))[1]
        )


def test_tables_follow_the_stream_handed_in_at_each_step(monkeypatch):
    si = install(monkeypatch)
    _log_lut_writes(monkeypatch, si)
    built_on = torch.cuda.Stream()
    with torch.cuda.stream(built_on):  # whatever is current while the pool is built
        eng = _engine()
    fwd1, fwd2 = torch.cuda.Stream(), torch.cuda.Stream()
    for fwd in (fwd1, fwd2):  # a later step may run on another stream
        start = len(si.log)
        eng.order.begin_forward(fwd)
        eng.order.end_forward()
        eng.recaller.recall([RecallRequest(0, eng.gen(0), (0, 1, 2), (3.0, 2.0, 1.0))])  # a worker-style recall
        writes = [o for o in si.log[start:] if o.resource in ("lut", "tables")]
        assert writes and {o.stream_name for o in writes} == {fwd.name}
        copies = [o for o in si.log[start:] if o.resource not in ("lut", "tables")]
        assert all(o.stream_name != built_on.name for o in copies)
        eng.recaller.recall([RecallRequest(0, eng.gen(0), (3, 4), (2.0, 1.0))])  # evicts: next round copies


class _SpyGate:
    """The engine's forward gate with a flag raised when another thread starts waiting for it."""

    def __init__(self, gate) -> None:
        self.gate, self.waiting = gate, threading.Event()

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            self.waiting.set()
        return self.gate.__enter__()

    def __exit__(self, *exc):
        return self.gate.__exit__(*exc)

    def acquire(self, *a, **k):
        return self.gate.acquire(*a, **k)

    def release(self):
        return self.gate.release()


def test_a_worker_recall_writes_its_tables_only_after_the_forward_is_enqueued(monkeypatch):
    si = install(monkeypatch)
    _log_lut_writes(monkeypatch, si)
    eng = _engine()
    fwd = torch.cuda.Stream()
    spy = eng.order._gate = _SpyGate(eng.order._gate)
    with torch.cuda.stream(fwd):
        eng.order.begin_forward()  # the decode thread starts enqueueing a forward
        worker = threading.Thread(
            target=eng.recaller.recall, args=([RecallRequest(0, eng.gen(0), (0, 1), (2.0, 1.0))],), name="worker"
        )
        worker.start()
        assert spy.waiting.wait(30), "the worker's recall never asked for the forward gate"
        layer_reads = [si.op("read", "lut") for _ in range(3)]  # the forward's layers, all enqueued meanwhile
        eng.order.end_forward()
    worker.join(30)
    assert not worker.is_alive()
    writes = [o for o in si.log if o.resource == "lut" and o.kind == "write" and o.thread == "worker"]
    assert writes and all(w.index > layer_reads[-1].index and w.after(layer_reads[-1]) for w in writes)


def test_level1_worker_sets_the_engine_device_before_any_cuda_call(monkeypatch):
    si = install(monkeypatch)
    eng = _engine()
    pol = ThresholdPagePolicy(SelectionConfig(page_chunks=4, kmax=2, last_keep=4))
    l1 = Level1(
        eng,
        lambda row, n, hid, pos: torch.ones(n),
        pol,
        Level1Config(tau=1, max_resident_pages=2, last_keep=4, async_recall=True),
    )
    try:
        l1.on_step([0], {}, torch.tensor([79]))
        l1.wait()
    finally:
        l1.close()
    calls = [name for thread, name in si.calls if thread == "flashmemory-level1"]
    assert calls and calls[0] == "set_device", calls
    assert ("flashmemory-level1", eng.device) in si.devices
