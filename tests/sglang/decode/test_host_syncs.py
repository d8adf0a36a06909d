"""Host syncs per decode step on the serving path, counted with device-standing tensors (tests/support).

sglang's inputs (seq_lens, req_pool_indices, req_to_token, the pool buffers) and every tensor the adapter, the core
and the runtime allocate with `device=` are `DeviceTensor`s; each read of their values by the host is a sync a GPU
would wait for. One steady decode step (no admission, no page boundary, no Level-1 cycle due) is counted on the
decode thread, through the runtime's hooks as sglang calls them (the guard's admission check, before_forward, the
forward's per-layer reads, after_decode_forward)."""

import threading
import types

import pytest
import torch

from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.runtime import Runtime
from tests.sglang.decode.test_copy_adapter import N_C4, PAGE, env, fake_pool
from tests.sglang.decode.test_shrink_adapter import sa  # noqa: F401 (the fixture)
from tests.support.cuda_standin import DeviceTensor, device_factories, on_device

pytestmark = pytest.mark.sglang
REQS = {"a": [5, 2, 9, 7], "b": [0, 1, 3, 4]}
SEQ0 = 3 * PAGE + 100  # 868 tokens, 217 c4 chunks: 4 pages


def _batch(seqs):
    mode = types.SimpleNamespace(is_decode=lambda: True, is_idle=lambda: False)
    s = torch.tensor(seqs)
    return types.SimpleNamespace(
        forward_mode=mode,
        rids=list(REQS),
        seq_lens=on_device(s),
        seq_lens_cpu=s,
        req_pool_indices=on_device(torch.tensor([1, 2])),
    )


# Copy mode's pool -> host-mirror copies of the c4 chunks a step closed, read at the next step (the forward stores
# them): bytes the host mirror must hold, so they are read by the host (the adapter reads the pool, the core's
# `store_chunks` writes the mirror and the resident cells). This pool has device tensors but no streams, so the
# core's `stage_chunks` writes the mirror at once; with streams it reads nothing back (test_decode_blocking.py).
MIRROR_COPIES = {"read_chunk_rows", "pool_chunks", "store_chunks", "stage_chunks"}


def test_a_steady_decode_step_syncs_the_host_only_where_justified(monkeypatch):
    device_factories(monkeypatch)
    pool = fake_pool(7)
    pool.c4_kv_pool.kv_buffer = [on_device(t) for t in pool.c4_kv_pool.kv_buffer]
    pool.c4_indexer_kv_pool.index_k_with_scale_buffer = [
        on_device(t) for t in pool.c4_indexer_kv_pool.index_k_with_scale_buffer
    ]
    adapter = build(pool, env("", async_recall=True, interval=64), shrink=False)
    rt = Runtime()
    rt.engine, rt.pool, rt.env, rt.diag_path = adapter, pool, adapter.env, ""
    r2t = torch.full((3, 4 * PAGE), -1, dtype=torch.int64)
    for i, pages in enumerate(REQS.values()):
        r2t[1 + i] = torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)])
    r2t = on_device(r2t)
    locs = on_device(torch.tensor([[5 * 64 + 3, -1]]))
    me = threading.current_thread().name
    per_step = []
    try:
        for step in range(5):  # tokens 869..873: chunk 217 closes at 872 (step 3), settled at step 4
            fb = _batch([SEQ0 + 1 + step] * 2)
            DeviceTensor.syncs = []
            rt.admission_refusals(fb)
            rt.before_forward(fb, r2t)
            for layer in range(N_C4):  # what the hooks run per c4 layer inside the forward
                adapter.cells_of(locs)
                adapter.refresh_from_pool(layer, locs[0])
            rt.after_decode_forward(fb)
            adapter.l1.wait()
            per_step.append([s for s in DeviceTensor.syncs if s[0] == me])
    finally:
        adapter.close()
    show = lambda syncs: "\n".join(s[2] for s in syncs)  # noqa: E731
    assert per_step[0], "the admissions read the histories from the pool: the counter sees nothing?"
    # Quiet steps and the step closing a chunk (its cells only: the forward stores its bytes): none.
    assert per_step[1] == per_step[2] == per_step[3] == [], show(per_step[1] + per_step[2] + per_step[3])
    syncs = per_step[4]  # the closed chunk is settled: mirror copies only
    assert syncs and {s[1] for s in syncs} <= MIRROR_COPIES, show(syncs)


def test_host_lengths_come_from_sglangs_host_copy_with_failed_rows_at_zero():
    from flashmemory.sglang.decode.guard import FAILED_PREFIX, _BatchView
    from flashmemory.sglang.decode.tables import host_seq_lens

    fb = _batch([900, 1000])
    DeviceTensor.syncs = []
    assert host_seq_lens(fb, list(REQS)).tolist() == [900, 1000] and DeviceTensor.syncs == []
    view = _BatchView(fb, [FAILED_PREFIX + "a", "b"], on_device(torch.tensor([0, 1000])))
    assert host_seq_lens(view, view.rids).tolist() == [0, 1000] and DeviceTensor.syncs == []
    del fb.seq_lens_cpu  # a batch without a host copy: one counted read
    assert host_seq_lens(fb, list(REQS)).tolist() == [900, 1000] and len(DeviceTensor.syncs) == 1


def test_shrink_settle_reads_only_the_bytes_the_mirror_keeps(sa, monkeypatch):
    """Shrink mode: after a forward that closed a chunk, `settle` reads that chunk's bytes (KV from the reserve,
    Path-I index-K) into the host mirror and nothing else: no host read of a mask or of a count."""
    from tests.sglang.decode.test_shrink_adapter import env as shrink_env
    from tests.sglang.decode.test_shrink_adapter import make_pool

    device_factories(monkeypatch)
    pool = make_pool(sa, monkeypatch, shrink=True)
    eng = build(pool, shrink_env(), sa.args, shrink=True)
    pages = torch.tensor([[9, 3, 40, 17]])
    seq0 = 3 * PAGE + 44  # token 3*PAGE+43 closes chunk 202 at step 0
    syncs = []
    try:
        for step in range(2):
            s = torch.tensor([seq0 + step])
            eng.begin_step(["a"], pages, s)
            DeviceTensor.syncs = []
            eng.settle()
            syncs.append([x[2] for x in DeviceTensor.syncs])
    finally:
        eng.close()
    kv_and_index = 1 + (1 if eng.index_shrink else len(eng.layout.offload_index_layers))
    assert len(syncs[0]) == kv_and_index and all(" cpu: " in x for x in syncs[0]), "\n".join(syncs[0])
    assert syncs[1] == [], "\n".join(syncs[1])  # nothing closed: nothing read
