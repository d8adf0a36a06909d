"""The DSv4 c4 / c128 compression step on CPU: a drop-in for sglang's `compress_forward`.

Stands in for `kernels/ops/attention/dsv4/compress.py::compress_forward` (JIT kernels `c4_v2.cuh`,
`c128_v2.cuh`; called from `srt/layers/attention/dsv4/compressor_v2.py:112`). Written from the format:

- `kv_score_input` [N, 2*coff*D] (fp32 from `linear_bf16_fp32(x, cat(wkv, wgate))`): per token
  `[kv | score]`; for c4 (coff 2) `[kv_a | kv_b | score_a | score_b]`, where the `a` half ("overlap", Ca)
  feeds the *next* window's entry and the `b` half (Cb) its own window's.
- `ape` [W, D]: the score bias per window slot, W = 8 for c4 (rows 0..3 bias the Ca slots, 4..7 the Cb
  slots: sglang's `_apply_ape_hotfix` layout of the checkpoint's [4, 2D] `ape`) and W = 128 for c128.
- Entry closing at position p (p + 1 = seq_len, a multiple of the ratio) is a per-channel softmax over W
  slots of (score + ape) weighting kv: c128 slots = tokens p-127..p; c4 slots 0..3 = Ca of tokens p-7..p-4,
  slots 4..7 = Cb of tokens p-3..p. For the first c4 entry (seq_len <= 4) slots 0..3 are kv 0, score -FLT_MAX.
- `kv_score_buffer` (the state pool, viewed [-1, ratio, 2*coff*D]) keeps raw rows of earlier tokens as flat
  ring rows (see `compress_plan`). Prefill: slot i < buffer_len is read from the ring (pages read_page_0 /
  read_page_1), later slots from `kv_score_input`; the ring writes of the plan_w rows happen after all
  compressions (sglang launches the compress kernel before the write kernel). Decode: every row first
  writes its token at write_loc, then rows that close a window read all W slots from the ring.

Output: `out` [num_plan_rows, D] (dtype of kv_score_input unless `out` is given); row k belongs to plan row
k. Rows that do not compress (invalid prefill rows, decode rows off a window boundary) are left as they
were (zero when `out` is allocated here; sglang leaves them uninitialised, and its store skips them).
Softmax and sums run in fp32 (the kernels use fp32 with `__expf`).
"""

from __future__ import annotations

from typing import Any

import torch

from flashmemory.sglang.cpu.ops.compress_plan import unpack_plan_c, unpack_plan_d, unpack_plan_w

_NEG = -torch.finfo(torch.float32).max  # the kernels' -FLT_MAX for the missing overlap slots


def _window(ratio: int) -> int:
    return 8 if ratio == 4 else 128


def _pool_slots(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """kv, score: [n, W, D]; ape [W, D] -> softmax_W(score + ape)-weighted sum of kv, fp32 [n, D]."""
    w = torch.softmax(score.float() + ape.float().unsqueeze(0), dim=1)
    return (w * kv.float()).sum(dim=1)


def _slot_rows(ratio: int, d: int, kv_src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split gathered rows [n, W, 2*coff*D] into (kv, score) [n, W, D] by slot role (Ca for c4 slots < 4)."""
    if ratio == 128:
        return kv_src[..., :d], kv_src[..., d : 2 * d]
    kv = torch.cat([kv_src[:, :4, :d], kv_src[:, 4:, d : 2 * d]], dim=1)
    score = torch.cat([kv_src[:, :4, 2 * d : 3 * d], kv_src[:, 4:, 3 * d :]], dim=1)
    return kv, score


def _mask_missing_overlap(kv: torch.Tensor, score: torch.Tensor, no_overlap: torch.Tensor) -> None:
    """In place: c4 rows with no previous window get kv 0 / score -FLT_MAX in slots 0..3."""
    if bool(no_overlap.any()):
        kv[no_overlap, :4] = 0
        score[no_overlap, :4] = _NEG


def _ring_rows(ratio: int, rp0: torch.Tensor, rp1: torch.Tensor) -> torch.Tensor:
    """Flat ring rows [n, W] of the window slots: c4 = page rp0 (4 rows) then page rp1; c128 = page rp1."""
    if ratio == 128:
        return rp1.unsqueeze(1) * 128 + torch.arange(128)
    four = torch.arange(4)
    return torch.cat([rp0.unsqueeze(1) * 4 + four, rp1.unsqueeze(1) * 4 + four], dim=1)


def compress_decode(
    buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan_d: torch.Tensor,
    *,
    head_dim: int,
    compress_ratio: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Decode step. buffer: flat ring rows [R, 2*coff*D] (written in place); kv_score_input [B, 2*coff*D];
    plan_d uint8 [B, 16]; out [B, D] (rows at window boundaries overwritten)."""
    p = unpack_plan_d(plan_d.cpu())
    n = kv_score_input.shape[0]
    if p.seq_len.numel() != n:
        raise ValueError(f"plan_d has {p.seq_len.numel()} rows but kv_score_input has {n}")
    buffer[p.write_loc.to(buffer.device)] = kv_score_input.to(buffer.dtype)
    if compress_ratio == 4:
        closes = p.seq_len % 4 == 0
    else:
        closes = p.write_loc % 128 == 127
    if not bool(closes.any()):
        return out
    rows = _ring_rows(compress_ratio, p.read_page_0[closes], p.read_page_1[closes])
    src = buffer[rows.to(buffer.device)].to(kv_score_input.dtype)
    kv, score = _slot_rows(compress_ratio, head_dim, src)
    kv, score = kv.clone(), score.clone()
    if compress_ratio == 4:
        _mask_missing_overlap(kv, score, (p.seq_len[closes] <= 4).to(kv.device))
    out[closes.to(out.device)] = _pool_slots(kv, score, ape).to(out.dtype)
    return out


def compress_prefill(
    buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan_c: torch.Tensor,
    plan_w: torch.Tensor,
    *,
    head_dim: int,
    compress_ratio: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Extend step. buffer: flat ring rows (written in place by plan_w after all compressions);
    kv_score_input [N, 2*coff*D] ragged tokens; plan_c [C, 16]; plan_w [M, 8]; out [C, D]."""
    pc = unpack_plan_c(plan_c.cpu())
    pw = unpack_plan_w(plan_w.cpu())
    if out.shape[0] != pc.seq_len.numel():
        raise ValueError(f"out has {out.shape[0]} rows but plan_c has {pc.seq_len.numel()}")
    win = _window(compress_ratio)
    valid = pc.valid
    if bool(valid.any()):
        rag, blen = pc.ragged_id[valid], pc.buffer_len[valid]
        slot = torch.arange(win)
        from_ring = slot.unsqueeze(0) < blen.unsqueeze(1)  # [n, W]
        in_rows = rag.unsqueeze(1) - (win - 1) + slot  # token row of each slot
        ring_rows = _ring_rows(compress_ratio, pc.read_page_0[valid].clamp_min(0), pc.read_page_1[valid].clamp_min(0))
        dev = kv_score_input.device
        from_in = kv_score_input[in_rows.clamp_min(0).to(dev)]
        from_buf = buffer[torch.where(from_ring, ring_rows, 0).to(buffer.device)].to(dev, kv_score_input.dtype)
        src = torch.where(from_ring.to(dev).unsqueeze(-1), from_buf, from_in)
        kv, score = _slot_rows(compress_ratio, head_dim, src)
        kv, score = kv.clone(), score.clone()
        if compress_ratio == 4:
            _mask_missing_overlap(kv, score, (pc.seq_len[valid] <= 4).to(dev))
        out[valid.to(out.device)] = _pool_slots(kv, score, ape).to(out.dtype)
    wv = pw.valid
    if bool(wv.any()):
        buffer[pw.write_loc[wv].to(buffer.device)] = kv_score_input[pw.ragged_id[wv].to(kv_score_input.device)].to(
            buffer.dtype
        )
    return out


def compress_forward(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan: Any,
    *,
    head_dim: int,
    compress_ratio: int,
    out: torch.Tensor | None = None,
    is_online: bool = False,
) -> torch.Tensor:
    """Drop-in for sglang's `compress_forward` (same arguments, same output rows; updates the ring in place).

    kv_score_buffer: the state pool viewed [-1, ratio, 2*coff*D] (any float dtype); kv_score_input
    [N, 2*coff*D]; ape [W, D]; plan: sglang's CompressorDecodePlan (`plan[1]` = plan_d) or
    CompressorPrefillPlan (`plan[1:3]` = plan_c, plan_w). Returns out [plan rows, D].
    """
    if is_online:
        raise NotImplementedError(
            "the online c128 compressor (SGLANG_OPT_USE_ONLINE_COMPRESS=1) has no CPU "
            "version; set SGLANG_OPT_USE_ONLINE_COMPRESS=0"
        )
    if compress_ratio not in (4, 128) or plan.compress_ratio != compress_ratio:
        raise ValueError(f"compress_ratio {compress_ratio} vs plan {plan.compress_ratio}: both must be 4 or 128")
    coff = 2 if compress_ratio == 4 else 1
    width = 2 * coff * head_dim
    if kv_score_input.shape[-1] != width or kv_score_buffer.shape[-1] != width:
        raise ValueError(
            f"kv_score rows must be {width} wide (2*coff*head_dim), got input "
            f"{tuple(kv_score_input.shape)} and buffer {tuple(kv_score_buffer.shape)}"
        )
    if tuple(ape.shape) != (_window(compress_ratio), head_dim):
        raise ValueError(f"ape must be [{_window(compress_ratio)}, {head_dim}], got {tuple(ape.shape)}")
    if not kv_score_buffer.is_contiguous():
        raise ValueError("kv_score_buffer must be contiguous (it is written through a flat view)")
    buffer = kv_score_buffer.view(-1, width)
    ape = ape.to(kv_score_input.dtype)  # as sglang: the kernels take ape in the input dtype
    if out is None:
        out = kv_score_input.new_zeros((plan[1].shape[0], head_dim))
    if plan.is_decode:
        return compress_decode(
            buffer, kv_score_input, ape, plan[1], head_dim=head_dim, compress_ratio=compress_ratio, out=out
        )
    return compress_prefill(
        buffer, kv_score_input, ape, plan[1], plan[2], head_dim=head_dim, compress_ratio=compress_ratio, out=out
    )
