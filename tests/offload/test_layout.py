"""Layout: DeepSeek-V4 sizes, and the page byte map agrees with the retriever's paged index-K format."""

import torch

from flashmemory.offload import OffloadLayout, PageFormat
from flashmemory.retriever.fp8 import chunks_to_pages, quantize_chunks


def test_default_sizes():
    lay = OffloadLayout()
    assert lay.kv.chunk_bytes == 584 and lay.kv_page_bytes == 37440 and lay.index_page_bytes == 8448
    assert len(lay.offload_index_layers) == 18 and 10 not in lay.offload_index_layers


def test_index_format_matches_fp8_pages_and_roundtrips():
    lay = OffloadLayout()
    chunks = quantize_chunks(torch.randn(150, 128))
    pages = chunks_to_pages(chunks)
    j = torch.arange(150)
    assert torch.equal(lay.index.read_chunks(pages, j // 64, j % 64), chunks)
    fresh = torch.zeros_like(pages)
    lay.index.write_chunks(fresh, j // 64, j % 64, chunks)
    assert torch.equal(fresh, pages)


def test_kv_segments_land_where_sglang_puts_them():
    f = PageFormat((576, 8), 64, 576)
    row = torch.zeros(1, f.page_bytes, dtype=torch.uint8)
    chunk = torch.arange(584).remainder(251).add(1).to(torch.uint8).view(1, 584)
    f.write_chunks(row, torch.tensor([0]), torch.tensor([5]), chunk)
    assert torch.equal(row[0, 5 * 576 : 6 * 576], chunk[0, :576])
    assert torch.equal(row[0, 36864 + 5 * 8 : 36864 + 6 * 8], chunk[0, 576:])
    assert int((row != 0).sum()) == int((chunk != 0).sum())
