"""The DSv4 compressor planner on CPU: sglang's plan tensors, byte for byte, without its JIT CUDA planner.

The plan bytes of `CompressorPrefillPlan.generate` / `CompressorDecodePlan.generate`
(`kernels/ops/attention/dsv4/compress.py`, planner `kernels/jit/csrc/deepseek_v4/c_plan.cuh`; the drop-ins that
wrap them in sglang's NamedTuples are in `cpu/patches_kernels.py`: this module imports no sglang). The plans are
uint8 tensors of packed little-endian structs (`include/sgl_kernel/deepseek_v4/compress_v2.cuh`):

- CompressPlan, 16 B per compression event (a token that closes a window, `(pos + 1) % ratio == 0`):
  `u32 seq_len (= pos + 1) | u16 ragged_id | u16 buffer_len | i32 read_page_0 | i32 read_page_1`.
  `buffer_len` = how many of the window's leading slots come from the state ring (earlier chunks).
  Invalid row: seq_len = 0xFFFFFFFF, ragged 0, buffer_len 0, pages -1.
- WritePlan, 8 B per token whose kv/score row must be kept in the state ring: `u32 ragged_id | i32 write_loc`.
  Invalid row: ragged = 0xFFFFFFFF, write_loc -1.
- DecodePlan, 16 B per request: `u32 seq_len | i32 write_loc | i32 read_page_0 | i32 read_page_1`.

State-ring addressing (a "page" is `ratio` consecutive ring rows):
- c128, or c4 with `use_req_ring`: row = rid * ring_size + pos % ring_size (one ring per request slot).
- c4 otherwise: the ring lives in the SWA pages: swa = full_to_state[req_to_token[rid, pos]],
  row = (swa // swa_page_size) * ring_size + swa % ring_size.

Assumption (as the CUDA planner): prefill plans with buffer_len == 0 keep read_page_0 = -1 and read_page_1 =
the batch index (kernel 1 only rewrites rows that read the ring); the consumers never read those pages.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PLAN_C_BYTES = 16
PLAN_W_BYTES = 8
PLAN_D_BYTES = 16
_INVALID_U32 = -1  # 0xFFFFFFFF as int32


def _ring_row(
    ratio: int,
    rid: torch.Tensor,
    pos: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_state: torch.Tensor,
    swa_page_size: int,
    ring_size: int,
    use_req_ring: bool,
) -> torch.Tensor:
    """State-ring row (int64) of token `pos` of request slot `rid` (both int64 tensors of one shape)."""
    if ratio == 128 or use_req_ring:
        return rid * ring_size + pos % ring_size
    raw = req_to_token[rid, pos].long()
    swa = full_to_state[raw].long()
    return (swa // swa_page_size) * ring_size + swa % ring_size


def _pack_i32(cols: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    """Columns of int64 values (already in int32 bit range) -> uint8 [n, nbytes] little-endian rows."""
    words = torch.stack([c.to(torch.int64) for c in cols], dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
    return words.view(torch.uint8).reshape(-1, nbytes)


def _check_ratio(compress_ratio: int) -> None:
    if compress_ratio not in (4, 128):
        raise ValueError(f"compress_ratio must be 4 or 128, got {compress_ratio}")


def plan_prefill(
    compress_ratio: int,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_state: torch.Tensor,
    swa_page_size: int,
    ring_size: int,
    num_q_tokens: int,
    use_cuda_graph: bool = False,
    use_req_ring: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(plan_c uint8 [num_c, 16], plan_w uint8 [num_w, 8]) for one extend batch, as `plan_compress_prefill`.

    req_pool_indices/seq_lens/extend_lens: [B] int (seq_lens counts the extend); req_to_token [R, S] int;
    full_to_state [F] int (full loc -> SWA loc). Rows are ordered by ragged token id (requests in batch order,
    tokens in position order). With use_cuda_graph both are padded to num_q_tokens rows with invalid plans.
    """
    _check_ratio(compress_ratio)
    if use_req_ring and compress_ratio != 4:
        raise ValueError("use_req_ring is only defined for compress_ratio 4")
    if ring_size % compress_ratio or swa_page_size % ring_size:
        raise ValueError(
            f"need swa_page_size % ring_size == 0 and ring_size % ratio == 0, got "
            f"swa_page_size={swa_page_size}, ring_size={ring_size}, ratio={compress_ratio}"
        )
    cr = compress_ratio
    overlap = cr == 4
    window = cr * (2 if overlap else 1)
    mtp_pad = ring_size - window + 2 if ring_size > window else 0
    seq = seq_lens.detach().cpu().long()
    ext = extend_lens.detach().cpu().long()
    if bool(((ext <= 0) | (ext > seq)).any()):
        raise ValueError(
            f"every extend_len must be in (0, seq_len]; seq_lens={seq.tolist()}, extend_lens={ext.tolist()}"
        )
    if int(ext.sum()) != num_q_tokens:
        raise ValueError(f"num_q_tokens={num_q_tokens} but extend_lens sum to {int(ext.sum())}")
    dev = req_to_token.device
    batch = torch.repeat_interleave(torch.arange(seq.numel()), ext)  # [N] batch id per token
    starts = torch.cumsum(ext, 0) - ext
    j = torch.arange(num_q_tokens) - starts[batch]  # index inside the extend
    pos = (seq - ext)[batch] + j
    ragged = torch.arange(num_q_tokens)
    rid = req_pool_indices.detach().cpu().long()[batch]

    is_c = (pos + 1) % cr == 0
    last_c = (seq // cr) * cr
    first_w = torch.minimum(last_c - (cr if overlap else 0), seq - mtp_pad)[batch]
    is_w = pos >= first_w
    if overlap and not use_req_ring:
        # The last `ratio` tokens of every SWA page are kept too: the next page's first window reads them.
        is_w |= pos % swa_page_size >= swa_page_size - cr

    r2t, f2s = req_to_token.cpu(), full_to_state.cpu()
    c_pos, c_rid = pos[is_c], rid[is_c]
    buf_len = window - torch.clamp(j[is_c] + 1, max=window)
    rp0 = torch.full_like(c_pos, -1)
    rp1 = batch[is_c].clone()
    reads = buf_len > 0
    if bool(reads.any()):
        p1 = c_pos[reads]
        p0 = (p1 - cr).clamp_min(0)
        args = (r2t, f2s, swa_page_size, ring_size, use_req_ring)
        rp0[reads] = _ring_row(cr, c_rid[reads], p0, *args) // cr
        rp1[reads] = _ring_row(cr, c_rid[reads], p1, *args) // cr
    plan_c = _pack_i32([c_pos + 1, ragged[is_c] + buf_len * 65536, rp0, rp1], PLAN_C_BYTES)

    w_pos = pos[is_w]
    w_loc = _ring_row(cr, rid[is_w], w_pos, r2t, f2s, swa_page_size, ring_size, use_req_ring)
    plan_w = _pack_i32([ragged[is_w], w_loc], PLAN_W_BYTES)

    if use_cuda_graph:
        plan_c = torch.cat([plan_c, invalid_plan_c(num_q_tokens - plan_c.shape[0])])
        plan_w = torch.cat([plan_w, invalid_plan_w(num_q_tokens - plan_w.shape[0])])
    return plan_c.to(dev), plan_w.to(dev)


def plan_decode(
    compress_ratio: int,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_state: torch.Tensor,
    seq_lens: torch.Tensor,
    swa_page_size: int,
    ring_size: int,
    use_req_ring: bool = False,
) -> torch.Tensor:
    """plan_d uint8 [B, 16] for one decode step, as `plan_compress_decode`.

    seq_lens [B] includes the token being decoded (position seq_len - 1); write_loc is that token's ring row,
    read_page_1 its ring page and read_page_0 the page of position max(seq_len - 1 - ratio, 0).
    """
    _check_ratio(compress_ratio)
    if use_req_ring and compress_ratio != 4:
        raise ValueError("use_req_ring is only defined for compress_ratio 4")
    cr = compress_ratio
    rid = req_pool_indices.detach().cpu().long()
    seq = seq_lens.detach().cpu().long()
    p1 = seq - 1
    p0 = (p1 - cr).clamp_min(0)
    args = (req_to_token.cpu(), full_to_state.cpu(), swa_page_size, ring_size, use_req_ring)
    write_loc = _ring_row(cr, rid, p1, *args)
    rp0 = _ring_row(cr, rid, p0, *args) // cr
    return _pack_i32([seq, write_loc, rp0, write_loc // cr], PLAN_D_BYTES).to(req_to_token.device)


def invalid_plan_c(n: int) -> torch.Tensor:
    """n invalid CompressPlan rows, uint8 [n, 16]."""
    z = torch.zeros(n, dtype=torch.int64)
    return _pack_i32([z + 2**32 - 1, z, z - 1, z - 1], PLAN_C_BYTES)


def invalid_plan_w(n: int) -> torch.Tensor:
    """n invalid WritePlan rows, uint8 [n, 8]."""
    z = torch.zeros(n, dtype=torch.int64)
    return _pack_i32([z + 2**32 - 1, z - 1], PLAN_W_BYTES)


class PlanC(NamedTuple):
    """Unpacked CompressPlan rows (int64 [n] each); `valid` is False for padding rows."""

    seq_len: torch.Tensor
    ragged_id: torch.Tensor
    buffer_len: torch.Tensor
    read_page_0: torch.Tensor
    read_page_1: torch.Tensor
    valid: torch.Tensor


class PlanW(NamedTuple):
    ragged_id: torch.Tensor
    write_loc: torch.Tensor
    valid: torch.Tensor


class PlanD(NamedTuple):
    seq_len: torch.Tensor
    write_loc: torch.Tensor
    read_page_0: torch.Tensor
    read_page_1: torch.Tensor


def _words(plan: torch.Tensor, nbytes: int, name: str) -> torch.Tensor:
    if plan.dtype != torch.uint8 or plan.dim() != 2 or plan.shape[1] != nbytes:
        raise ValueError(f"{name}: expected uint8 [n, {nbytes}], got {plan.dtype} {tuple(plan.shape)}")
    return plan.contiguous().view(torch.int32).long()


def unpack_plan_c(plan_c: torch.Tensor) -> PlanC:
    w = _words(plan_c, PLAN_C_BYTES, "plan_c")
    seq_len = w[:, 0] & 0xFFFFFFFF
    return PlanC(seq_len, w[:, 1] & 0xFFFF, (w[:, 1] >> 16) & 0xFFFF, w[:, 2], w[:, 3], seq_len != 0xFFFFFFFF)


def unpack_plan_w(plan_w: torch.Tensor) -> PlanW:
    w = _words(plan_w, PLAN_W_BYTES, "plan_w")
    ragged = w[:, 0] & 0xFFFFFFFF
    return PlanW(ragged, w[:, 1], ragged != 0xFFFFFFFF)


def unpack_plan_d(plan_d: torch.Tensor) -> PlanD:
    w = _words(plan_d, PLAN_D_BYTES, "plan_d")
    return PlanD(w[:, 0] & 0xFFFFFFFF, w[:, 1], w[:, 2], w[:, 3])
