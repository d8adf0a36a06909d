"""The torch compression metadata equals sglang's Triton kernel (run in Triton's interpreter, as on CPU)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flashmemory.sglang.cpu.ops.metadata import init_compression_metadata

pytestmark = pytest.mark.sglang

_COMPARE = textwrap.dedent("""
    import torch
    from sglang.kernels.ops.attention.dsv4.metadata_kernel import init_compression_metadata as triton_meta
    from flashmemory.sglang.cpu.ops.metadata import init_compression_metadata as torch_meta
    g = torch.Generator().manual_seed(0)
    for bs, writes, pages, page_size, with_pages in [(1, 1, 1, 256, True), (37, 37, 9, 256, True),
                                                     (50, 41, 6, 512, True), (20, 20, 4, 256, False)]:
        seq_lens = torch.randint(1, pages * page_size, (bs,), generator=g, dtype=torch.int32)
        seq_lens[:3] = torch.tensor([128, 4, 256])[:bs]          # rows that write a c4 and a c128 entry
        positions = (seq_lens - 1).to(torch.int64)
        raw = torch.randint(0, 1 << 20, (writes,), generator=g, dtype=torch.int64)
        table = torch.randint(0, 5000, (bs, pages), generator=g, dtype=torch.int32)
        want = triton_meta(seq_lens, positions, raw, table, page_size, compute_page_indices=with_pages)
        got = torch_meta(seq_lens, positions, raw, table, page_size, compute_page_indices=with_pages)
        for i, (w, o) in enumerate(zip(want, got)):
            if w is None or o is None:
                assert w is None and o is None, (bs, i)
                continue
            assert w.dtype == o.dtype and w.shape == o.shape, (bs, i, w.dtype, o.dtype, w.shape, o.shape)
            assert torch.equal(w, o), (bs, i, w, o)
    print("EQUAL")
""")


def test_matches_sglang_triton_kernel_in_the_interpreter():
    pytest.importorskip("sglang")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _COMPARE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "EQUAL" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_page_indices_and_lengths_by_hand():
    seq_lens = torch.tensor([4, 257, 128], dtype=torch.int32)
    out = init_compression_metadata(
        seq_lens,
        (seq_lens - 1).long(),
        torch.tensor([40, 81, 1280]),
        torch.tensor([[3, 7], [1, 2], [9, 0]], dtype=torch.int32),
        256,
    )
    c4_loc, c4_pos, c4_raw, c4_c1, c128_loc, c128_pos, c128_raw, c128_c1, pages = out
    assert c4_loc.tolist() == [10, 0, 320] and c4_raw.tolist() == [1, 64, 32] and c4_pos.tolist() == [0, 256, 124]
    assert c128_loc.tolist() == [0, 0, 10] and c128_raw.tolist() == [0, 2, 1] and c128_c1.tolist() == [1, 2, 1]
    assert pages.tolist() == [[-1, -1, -1, -1], [2, 3, -1, -1], [18, -1, -1, -1]]


def test_more_write_rows_than_tokens_is_refused():
    with pytest.raises(ValueError, match="raw_out_loc has 3 rows"):
        init_compression_metadata(torch.ones(2, dtype=torch.int32), torch.zeros(2), torch.zeros(3), None, 0, False)
