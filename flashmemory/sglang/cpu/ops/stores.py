"""fp8 paged stores of DSv4's c4/c128/SWA KV entries (584 B) and index-K entries (132 B) on CPU.

Formats (sglang 0.5.23 `KVLayout.V4`, `kernels/jit/csrc/deepseek_v4/{store,fused_norm_rope_v2,main_norm_rope}.cuh`;
the HIP Triton store `kernels/ops/kvcache/triton_store_cache.py` writes the same bytes):

- KV entry, 584 B = 576 data + 8 scale bytes. Data: dims 0..447 as float8_e4m3fn in 7 groups of 64, each
  scaled by a power of two `2^(e-127)` stored as the ue8m0 byte e, where e rounds max(amax, 1e-4) / 448 *up*
  to a power of two (exponent + 1 if any mantissa bit is set); value = e4m3(clamp(x * 2^(127-e), +-448)),
  round-to-nearest-even. Then dims 448..511 (the rope part) as 64 bf16 (128 B). Scale bytes: the 7 exponents
  and 1 pad byte, which sglang never writes (kept as found here).
  A page of P entries is [P x 576 data | P x 8 scales], padded to a multiple of 576 B (37,440 B at P = 64).
- Index-K entry, 132 B = 128 x float8_e4m3fn + one fp32 scale = max(amax, 1e-4) / 448 (not a power of two),
  value = e4m3(clamp(x * (1 / scale), +-448)). A page is [P x 128 fp8 | P x 4 scale] (8,448 B at P = 64).

The byte layout of a page row reuses `flashmemory.offload.PageFormat` and the 132-B codec
`flashmemory.retriever.fp8`. Locations: page = loc // P, slot = loc % P; a negative loc is skipped.
"""

from __future__ import annotations

import torch

from flashmemory.offload import PageFormat
from flashmemory.retriever.fp8 import FP8, FP8_MAX, quantize_chunks

KV_DIM = 512
KV_NOPE_DIM = 448
KV_ROPE_DIM = 64
KV_GROUP = 64
KV_DATA_BYTES = 576
KV_SCALE_BYTES = 8
KV_ENTRY_BYTES = KV_DATA_BYTES + KV_SCALE_BYTES
INDEX_HEAD_DIM = 128
SCALE_EPS = 1e-4


def kv_page_format(page_size: int) -> PageFormat:
    """Page-row format of the 584-B KV pool (data segment, scale segment, rows padded to 576 B)."""
    return PageFormat((KV_DATA_BYTES, KV_SCALE_BYTES), page_size, KV_DATA_BYTES)


def index_page_format(page_size: int, head_dim: int = INDEX_HEAD_DIM) -> PageFormat:
    """Page-row format of the index-K pool: [P x head_dim fp8 | P x 4 fp32 scale]."""
    return PageFormat((head_dim, 4), page_size, 1)


def ue8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scale [...] -> int32 biased exponent e with 2^(e-127) >= scale, the least such power of two
    (for normal positive scales): the float's exponent bits, plus one if any mantissa bit is set."""
    bits = scale.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def ue8m0_inverse(exponent: torch.Tensor) -> torch.Tensor:
    """int32 biased exponent e -> fp32 2^(127-e), exactly."""
    return ((254 - exponent) << 23).to(torch.int32).view(torch.float32)


def quantize_kv_entries(x: torch.Tensor, *, round_nope_to_bf16: bool) -> torch.Tensor:
    """x [N, 512] float (normed and rope-rotated) -> uint8 [N, 584] entries (pad byte 0).

    round_nope_to_bf16: round the nope dims to bf16 before taking amax and quantizing, as the compressor's
    store does (`fused_norm_rope_v2.cuh`); the SWA-KV store (`main_norm_rope.cuh`) quantizes the fp32 value.
    """
    if x.dim() != 2 or x.shape[1] != KV_DIM:
        raise ValueError(f"KV entries must be [N, {KV_DIM}], got {tuple(x.shape)}")
    x = x.float()
    n = x.shape[0]
    nope = x[:, :KV_NOPE_DIM]
    if round_nope_to_bf16:
        nope = nope.bfloat16().float()
    groups = nope.reshape(n, KV_NOPE_DIM // KV_GROUP, KV_GROUP)
    exp = ue8m0_exponent(groups.abs().amax(dim=-1).clamp_min(SCALE_EPS) / FP8_MAX)  # [N, 7]
    q = (groups * ue8m0_inverse(exp).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    rope = x[:, KV_NOPE_DIM:].bfloat16().contiguous().view(torch.uint8)  # [N, 128]
    scales = torch.cat([exp.to(torch.uint8), torch.zeros(n, 1, dtype=torch.uint8, device=x.device)], dim=1)
    return torch.cat([q.view(torch.uint8).reshape(n, KV_NOPE_DIM), rope, scales], dim=1)


def dequantize_kv_entries(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 584] entries -> float32 [N, 512] (fp8 times 2^(e-127) for the nope dims, bf16 rope)."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != KV_ENTRY_BYTES:
        raise ValueError(f"KV entries must be uint8 [N, {KV_ENTRY_BYTES}], got {rows.dtype} {tuple(rows.shape)}")
    rows = rows.contiguous()
    n = rows.shape[0]
    vals = rows[:, :KV_NOPE_DIM].contiguous().view(FP8).float().reshape(n, -1, KV_GROUP)
    exp = rows[:, KV_DATA_BYTES : KV_DATA_BYTES + KV_NOPE_DIM // KV_GROUP].to(torch.int32)
    scale = (exp << 23).view(torch.float32)
    rope = rows[:, KV_NOPE_DIM:KV_DATA_BYTES].contiguous().view(torch.bfloat16).float()
    return torch.cat([(vals * scale.unsqueeze(-1)).reshape(n, KV_NOPE_DIM), rope], dim=1)


def quantize_index_entries(x: torch.Tensor) -> torch.Tensor:
    """x [N, 128] float (normed, rotated, Hadamard-transformed) -> uint8 [N, 132] entries."""
    return quantize_chunks(x, eps=SCALE_EPS, by_reciprocal=True)


def _page_rows(cache: torch.Tensor, fmt: PageFormat, name: str) -> torch.Tensor:
    if cache.dtype != torch.uint8:
        cache = cache.view(torch.uint8)
    if not cache.is_contiguous() or cache.numel() % fmt.page_bytes:
        raise ValueError(
            f"{name}: expected a contiguous uint8 pool of {fmt.page_bytes}-byte pages, got "
            f"{cache.dtype} {tuple(cache.shape)}"
        )
    return cache.view(-1, fmt.page_bytes)


def write_entries(
    cache: torch.Tensor,
    fmt: PageFormat,
    locs: torch.Tensor,
    rows: torch.Tensor,
    keep_tail_bytes: int = 0,
    name: str = "cache",
) -> None:
    """Scatter entry rows [N, fmt.chunk_bytes] into the paged pool `cache` (in place) at pool locs [N].

    Negative locs are skipped. keep_tail_bytes: leave the last bytes of each entry as they are in the pool
    (the KV entry's pad byte, which sglang's stores never write). Later rows win on duplicate locs.
    """
    pages = _page_rows(cache, fmt, name)
    locs = locs.reshape(-1).long().to(pages.device)
    keep = locs >= 0
    if not bool(keep.any()):
        return
    locs, rows = locs[keep], rows[keep.to(rows.device)].to(pages.device)
    page, slot = locs // fmt.page_chunks, locs % fmt.page_chunks
    if int(page.max()) >= pages.shape[0]:
        raise IndexError(f"{name}: loc {int(locs.max())} is past the pool's {pages.shape[0]} pages")
    if keep_tail_bytes:
        old = fmt.read_chunks(pages, page, slot)
        rows = torch.cat([rows[:, :-keep_tail_bytes], old[:, -keep_tail_bytes:]], dim=1)
    fmt.write_chunks(pages, page, slot, rows)


def store_kv_entries(
    cache: torch.Tensor, locs: torch.Tensor, x: torch.Tensor, page_size: int, *, round_nope_to_bf16: bool
) -> None:
    """Quantize x [N, 512] to 584-B entries and write them into the KV pool at locs [N] (negative = skip)."""
    write_entries(
        cache,
        kv_page_format(page_size),
        locs,
        quantize_kv_entries(x, round_nope_to_bf16=round_nope_to_bf16),
        keep_tail_bytes=1,
        name="KV pool",
    )


def store_index_entries(cache: torch.Tensor, locs: torch.Tensor, x: torch.Tensor, page_size: int) -> None:
    """Quantize x [N, 128] to 132-B entries and write them into the index-K pool at locs [N]."""
    write_entries(
        cache, index_page_format(page_size, x.shape[-1]), locs, quantize_index_entries(x), name="index-K pool"
    )


def fused_store_cache(
    input: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    page_size: int,
    type: str,
    layout: object = "v4",
    freqs_cis: torch.Tensor | None = None,
) -> None:
    """Drop-in for sglang's `fused_store_cache` (`kernels/ops/attention/dsv4/attn.py:75`), V4 layout only.

    type "flashmla": input [N, 512] (bf16, already normed and rotated) -> 584-B entries;
    type "indexer": input [N, 128] -> 132-B entries. indices [N] pool locs.
    """
    if str(getattr(layout, "value", layout)).lower() != "v4" or freqs_cis is not None:
        raise NotImplementedError(
            f"fused_store_cache on CPU supports the V4 layout only (got {layout!r}); set SGLANG_DSV4_KV_LAYOUT=v4"
        )
    if type == "flashmla":
        store_kv_entries(cache, indices, input, page_size, round_nope_to_bf16=False)
    elif type == "indexer":
        store_index_entries(cache, indices, input, page_size)
    else:
        raise ValueError(f"fused_store_cache: type must be 'flashmla' or 'indexer', got {type!r}")
