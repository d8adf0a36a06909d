"""sglang's own compressor call site (`CompressorBackendMixin._forward_compress_all_in_one`) runs on the CPU ops.

The plan comes from the drop-in `generate_prefill` / `generate_decode` (sglang's NamedTuples), `compress_forward`
and `compress_norm_rope_store` are swapped into `compressor_v2` (as the patch layer will), and the pool bytes must
equal what the test harness (which calls the ops directly) writes for the same request.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashmemory.sglang.cpu.ops import compressor, norm_rope
from flashmemory.sglang.cpu.patches_kernels import generate_decode, generate_prefill
from tests.sglang.cpu.compress_harness import POOL_PAGE, CompressorSetup, Harness, run
from tests.sglang.cpu.test_norm_rope import _freqs


@pytest.mark.parametrize("ratio,head_dim", [(4, 512), (4, 128), (128, 512)])
def test_forward_compress_all_in_one_on_cpu(monkeypatch, ratio, head_dim):
    cv2 = pytest.importorskip("sglang.srt.layers.attention.dsv4.compressor_v2")
    monkeypatch.setattr(cv2, "compress_forward", compressor.compress_forward)
    monkeypatch.setattr(cv2, "compress_norm_rope_store", norm_rope.compress_norm_rope_store)
    g = torch.Generator().manual_seed(ratio + head_dim)
    coff = 2 if ratio == 4 else 1
    win = 8 if ratio == 4 else 128
    setup = CompressorSetup(
        ratio,
        head_dim,
        torch.randn(win, head_dim, generator=g),
        1 + 0.2 * torch.randn(head_dim, generator=g),
        1e-6,
        _freqs(1024)[0],
    )
    n = 300
    kv_score = torch.randn(n, 2 * coff * head_dim, generator=g)
    steps = [([(0, 0, 260)], False)] + [([(0, p, p + 1)], True) for p in range(260, n)]
    want = run(setup, {0: kv_score}, steps, seed=5)

    h = Harness(setup, seed=5)  # same tables, NaN state and random pool bytes as `want` started from
    for (batch,), decode in [(b, d) for b, d in steps]:
        _, a, e = batch
        rid, seq = torch.tensor([0]), torch.tensor([e])
        if decode:
            plan = generate_decode(ratio, rid, h.req_to_token, h.full_to_swa, seq, h.swa_page, h.ring)
        else:
            plan = generate_prefill(
                ratio, rid, seq, torch.tensor([e - a]), h.req_to_token, h.full_to_swa, h.swa_page, h.ring, e - a
            )
        meta = SimpleNamespace(**{f"c{ratio}_compress_metadata": plan})
        backend = object.__new__(cv2.CompressorBackendMixin)  # only forward_metadata is read
        backend.forward_metadata = meta
        backend._forward_compress_all_in_one(
            kv_score_buffer=h.state,
            kv_score_input=kv_score[a:e],
            ape=setup.ape,
            head_dim=head_dim,
            norm=SimpleNamespace(weight=setup.norm_weight, variance_epsilon=setup.eps),
            freqs_cis_cache=setup.freqs_cis,
            kv_cache=h.pool,
            is_indexer=head_dim == 128,
            rotate=head_dim == 128,
            compress_ratio=ratio,
            page_size=POOL_PAGE,
            out_loc=h.entry_loc(0, torch.arange(a, e) // ratio),
        )
    t = n // ratio
    assert torch.equal(h.read_entries(0, t), want.read_entries(0, t))
    assert torch.equal(h.pool, want.pool)
