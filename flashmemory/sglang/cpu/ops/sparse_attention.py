"""DSv4 sparse MLA attention over the fp8 paged KV pools, on CPU: FlashMLA's decode call, in torch.

Same semantics as sglang's own torch fallback `kernels/ops/attention/flash_mla_sm120.py::_sm120_sparse_decode_fwd`
(its test reference): per query token, softmax over the SWA picks `indices` and the compressed picks
`extra_indices` (one joint softmax, with the attention sink as an extra logit), values = the first
`head_dim_v` dims of the same entries. sglang's version gathers every picked entry byte by byte (a 576-wide
int64 index per pick); here each *page* a pick touches is dequantized once and the rows are gathered from
that, which makes a 1K-token forward several times faster on CPU with the same numbers (dequantized entries
are rounded to bf16 as sglang does before the fp32 products).

Pool page layout (V4, `deepseek_v4_memory_pool.py`): [P x 576 data | P x 8 scale bytes | pad]; data = 448
fp8 e4m3 nope values, then 64 bf16 rope values; scale bytes 0..6 = ue8m0 exponents of the 7 groups of 64.
"""

from __future__ import annotations

import torch

NOPE = 448
ROPE = 64
DATA = NOPE + 2 * ROPE  # 576
GROUPS = NOPE // 64  # 7
SCALE = GROUPS + 1  # 8
DIM = NOPE + ROPE  # 512
TOKEN_BLOCK = 64  # query tokens per block: bounds the gathered [T, picks, 512] tensor


def dequantize_pages(k_cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """k_cache (num_pages, P, 1, bytes) fp8/uint8 view with a page stride; pages [n] int64 ->
    bf16 [n * P, 512]: row i*P + s is slot s of pages[i], nope = fp8 * 2^(e-127), rope as stored."""
    num_pages, p = k_cache.shape[0], k_cache.shape[1]
    page_bytes = k_cache.stride(0)
    raw = k_cache.as_strided((num_pages, page_bytes), (page_bytes, 1)).view(torch.uint8)[pages]
    n = raw.shape[0]
    data = raw[:, : p * DATA].reshape(n * p, DATA)
    scale_bytes = raw[:, p * DATA : p * DATA + p * SCALE].reshape(n * p, SCALE)[:, :GROUPS]
    nope = data[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(n * p, GROUPS, 64)
    scale = (scale_bytes.to(torch.int32) << 23).view(torch.float32)  # 2^(e-127); e = 0 -> 0 (never written)
    out = torch.empty(n * p, DIM, dtype=torch.bfloat16, device=k_cache.device)
    out[:, :NOPE] = (nope * scale.unsqueeze(-1)).reshape(n * p, NOPE).to(torch.bfloat16)
    out[:, NOPE:] = data[:, NOPE:].contiguous().view(torch.bfloat16)
    return out


def _picked_rows(
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """indices [B, S, K] token-level pool locs (-1 = none), lengths [B] or None -> (rows fp32 [U * P, 512]: the
    dequantized pages the valid picks touch, local int64 [B, S, K]: each pick's row in `rows`, invalid bool
    [B, S, K]). An invalid pick's local is -1 (the caller points it at a zero row)."""
    p = k_cache.shape[1]
    b, s, k = indices.shape
    invalid = indices < 0
    if lengths is not None:
        invalid = invalid | (torch.arange(k, device=indices.device).view(1, 1, k) >= lengths.view(b, 1, 1))
    idx = indices.long().clamp_min(0)
    page = idx // p
    used = torch.unique(page[~invalid]) if bool((~invalid).any()) else page.new_zeros(1)
    rows = dequantize_pages(k_cache, used).float()  # bf16 -> fp32 is exact: the same numbers as before
    local = torch.searchsorted(used, page.clamp(max=int(used.max()))) * p + idx % p
    local = torch.where(invalid, torch.full_like(local, -1), local.clamp(max=rows.shape[0] - 1))
    return rows, local, invalid


def _gather_both(
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None,
    extra_k_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SWA picks then the compressed picks of each token, as one [B, S, K + K2, 512] fp32 gather from one
    table (both pools' touched rows and a zero row for invalid picks): no concatenation or masking pass over the
    gathered tensor, which dominated a CPU prefill forward."""
    rows, local, invalid = _picked_rows(k_cache, indices, lengths)
    parts, locals_, invalids = [rows], [local], [invalid]
    if extra_k_cache is not None and extra_indices is not None:
        erows, elocal, einv = _picked_rows(extra_k_cache, extra_indices, extra_lengths)
        parts.append(erows)
        locals_.append(torch.where(einv, elocal, elocal + rows.shape[0]))
        invalids.append(einv)
    table = torch.cat(parts + [rows.new_zeros(1, DIM)])
    local, invalid = torch.cat(locals_, dim=2), torch.cat(invalids, dim=2)
    local = torch.where(invalid, torch.full_like(local, table.shape[0] - 1), local)
    return table.index_select(0, local.reshape(-1)).reshape(*local.shape, DIM), invalid


def sparse_decode_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    head_dim_v: int,
    softmax_scale: float,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, S, H, D>=512] (bf16), k_cache/extra_k_cache pools as in `dequantize_pages`, indices [B, S, K],
    extra_indices [B, S, K2] -> (out bf16 [B, S, H, head_dim_v], lse fp32 [B, H, S]); tokens with no valid
    pick get out 0 and lse -inf. Computed in blocks of TOKEN_BLOCK tokens along B (memory bound)."""
    outs, lses = [], []
    for lo in range(0, q.shape[0], TOKEN_BLOCK):
        hi = min(lo + TOKEN_BLOCK, q.shape[0])
        kv, invalid = _gather_both(
            k_cache,
            indices[lo:hi],
            None if topk_length is None else topk_length[lo:hi],
            extra_k_cache,
            None if extra_indices is None else extra_indices[lo:hi],
            None if extra_topk_length is None else extra_topk_length[lo:hi],
        )
        o, lse = _attend(q[lo:hi], kv, invalid, attn_sink, head_dim_v, softmax_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=0)


def _attend(
    q: torch.Tensor,
    kv: torch.Tensor,
    invalid: torch.Tensor,
    attn_sink: torch.Tensor | None,
    head_dim_v: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    h = q.shape[2]
    qf = q.float()[..., : kv.shape[-1]]
    scores = torch.einsum("bshd,bstd->bsht", qf, kv) * softmax_scale
    scores.masked_fill_(invalid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, S, H]
    norm = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.float().view(1, 1, h))
    lonely = torch.isneginf(lse)
    norm = norm.masked_fill(lonely, float("inf"))
    weights = torch.exp(scores - norm.unsqueeze(-1))
    out = torch.einsum("bsht,bstv->bshv", weights, kv[..., :head_dim_v])
    out = out.masked_fill(lonely.unsqueeze(-1), 0.0)
    return out.to(torch.bfloat16), lse.permute(0, 2, 1)
