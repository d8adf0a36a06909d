"""The 132-byte fp8 index-key chunk and sglang's paged index-K layout.

A chunk is D bytes of float8_e4m3fn followed by one little-endian float32 scale (D + 4 bytes;
132 at D = 128), and k = fp8 * scale. sglang stores 64 chunks per page as
[64*D fp8 bytes | 64 x 4 scale bytes] (8,448 B at D = 128).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PAGE_CHUNKS = 64


def chunk_bytes(head_dim: int) -> int:
    """Bytes per chunk: `head_dim` fp8 values plus a 4-byte fp32 scale."""
    return head_dim + 4


def quantize_chunks(k: torch.Tensor, eps: float = 1e-4, by_reciprocal: bool = False) -> torch.Tensor:
    """Quantize keys to chunks. k: [N, D] float -> [N, D+4] uint8, per-chunk scale = max(amax, eps) / 448.

    by_reciprocal: multiply by the fp32 reciprocal of the scale instead of dividing, as sglang's CUDA index-K
    stores do (the two can differ by one fp32 ulp, which can move a value across an fp8 rounding boundary).
    """
    if k.dim() != 2:
        raise ValueError(f"quantize_chunks expects [N, D], got {tuple(k.shape)}")
    k = k.float()
    scale = k.abs().amax(dim=-1, keepdim=True).clamp_min(eps) / FP8_MAX
    scaled = k * (1.0 / scale) if by_reciprocal else k / scale
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat((q.view(torch.uint8), scale.contiguous().view(torch.uint8)), dim=-1)


def split_chunks(chunks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chunks: [..., D+4] uint8 -> (fp8 values [..., D] as float8_e4m3fn, scale [...] float32)."""
    if chunks.dtype != torch.uint8 or chunks.shape[-1] < 5:
        raise ValueError(f"expected uint8 chunks [..., D+4], got {chunks.dtype} {tuple(chunks.shape)}")
    d = chunks.shape[-1] - 4
    c = chunks.contiguous()
    vals = c[..., :d].contiguous().view(FP8)
    scale = c[..., d:].contiguous().view(torch.float32).squeeze(-1)
    return vals, scale


def dequantize_chunks(chunks: torch.Tensor) -> torch.Tensor:
    """chunks: [..., D+4] uint8 -> keys [..., D] float32 (fp8 value times its chunk scale)."""
    vals, scale = split_chunks(chunks)
    return vals.float() * scale.unsqueeze(-1)


def chunks_to_pages(chunks: torch.Tensor, page_chunks: int = PAGE_CHUNKS) -> torch.Tensor:
    """[N, D+4] chunk rows -> [ceil(N/64), 64*(D+4)] sglang index-K pages; the tail of the last page is zero."""
    n, cb = chunks.shape
    d = cb - 4
    n_pages = -(-n // page_chunks)
    padded = torch.zeros(n_pages * page_chunks, cb, dtype=torch.uint8, device=chunks.device)
    padded[:n] = chunks
    padded = padded.view(n_pages, page_chunks, cb)
    vals = padded[:, :, :d].reshape(n_pages, page_chunks * d)
    scales = padded[:, :, d:].reshape(n_pages, page_chunks * 4)
    return torch.cat((vals, scales), dim=1)


def pages_to_chunks(pages: torch.Tensor, n_chunks: int, head_dim: int, page_chunks: int = PAGE_CHUNKS) -> torch.Tensor:
    """Inverse of `chunks_to_pages`: [P, 64*(D+4)] pages -> the first `n_chunks` chunk rows [n_chunks, D+4]."""
    p, width = pages.shape
    if width != page_chunks * chunk_bytes(head_dim):
        raise ValueError(f"page width {width} != {page_chunks} x {chunk_bytes(head_dim)} for head_dim={head_dim}")
    if n_chunks > p * page_chunks:
        raise ValueError(f"{n_chunks} chunks do not fit in {p} pages of {page_chunks}")
    vals = pages[:, : page_chunks * head_dim].reshape(p, page_chunks, head_dim)
    scales = pages[:, page_chunks * head_dim :].reshape(p, page_chunks, 4)
    return torch.cat((vals, scales), dim=2).reshape(p * page_chunks, head_dim + 4)[:n_chunks].contiguous()
