"""Stock vs HiSparse vs FlashMemory side by side (a projection, nothing measured), and the check of the model
against HiSparse's one published DeepSeek-V4-Flash figure.

Arms, per request of `ctx` tokens:
- stock: every KV region on the device; native indexer over the whole history at 21 c4 layers.
- hisparse: `flashmemory.costmodel.hisparse` (hot buffer + full index keys on device; synchronous swap-in).
- flashmemory: KMAX pages resident (KMAX scaled as upstream's 96 pages at 256K), Path-I at >= 1M; recall async.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from flashmemory.costmodel.bytes import PolicyKnobs, RequestBytes, baseline_bytes, flashmemory_bytes
from flashmemory.costmodel.flops import baseline_flops, flashmemory_flops
from flashmemory.costmodel.hisparse import HiSparseKnobs, hisparse_bytes
from flashmemory.costmodel.throughput import Hardware, estimate, kv_budget_per_gpu, step_time, throughput_at

PEER_CONTEXTS = (131072, 262144, 1048576)
PEER_BATCHES = (1, 16, 64)
POLICIES = ("stock", "hisparse", "flashmemory")


def kmax_for(ctx: int) -> int:
    """Upstream's residency: 96 pages of 64 chunks at 256K (~9.4% of the c4 history), scaled with ctx."""
    return max(1, round(ctx * 96 / 262144))


@dataclass(frozen=True)
class PeerCell:
    """One arm at one context: device/host bytes per request, the concurrency ceiling and what bounds it, and
    tok/s (roofline and with the fixed per-step overhead) at each batch; None where the batch does not fit."""

    policy: str
    ctx: int
    kmax: int
    device_bytes: float
    host_bytes: float
    device_parts: dict[str, float]
    max_conc: int
    bound: str
    tok_s_roof: dict[int, float | None]
    tok_s: dict[int, float | None]


def _arm(policy: str, ctx: int, kmax: int, fm: PolicyKnobs, hs: HiSparseKnobs) -> tuple[RequestBytes, float, bool,
                                                                                          float]:
    """(bytes, FLOPs per token, synchronous PCIe, extra ms per step) of one arm."""
    if policy == "stock":
        return baseline_bytes(ctx), baseline_flops(ctx).total, False, 0.0
    if policy == "hisparse":
        return hisparse_bytes(ctx, hs), baseline_flops(ctx).total, True, hs.step_overhead_ms
    if policy == "flashmemory":
        return flashmemory_bytes(ctx, kmax, fm), flashmemory_flops(ctx, kmax).total, False, 0.0
    raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")


def peer_table(hw: Hardware, hs: HiSparseKnobs = HiSparseKnobs(), contexts: tuple[int, ...] = PEER_CONTEXTS,
               batches: tuple[int, ...] = PEER_BATCHES, fm_knobs: Callable[[int], PolicyKnobs] | None = None,
               overhead_ms: float = 20.0) -> list[PeerCell]:
    """Every arm at every context; `fm_knobs(ctx)` defaults to Path-I at >= 1M, worst-case turnover."""
    knobs = fm_knobs or (lambda c: PolicyKnobs(path_i=c >= 1048576))
    roof = dataclasses.replace(hw, overhead_ms=0.0)
    over = dataclasses.replace(hw, overhead_ms=overhead_ms)
    cells = []
    for ctx in contexts:
        kmax = kmax_for(ctx)
        for policy in POLICIES:
            req, fl, sync, extra = _arm(policy, ctx, kmax, knobs(ctx), hs)
            est = estimate(req, fl, roof, sync_pcie=sync, extra_ms=extra)
            tr = {b: throughput_at(req, fl, roof, b, sync_pcie=sync, extra_ms=extra) for b in batches}
            to = {b: throughput_at(req, fl, over, b, sync_pcie=sync, extra_ms=extra) for b in batches}
            cells.append(PeerCell(policy, ctx, kmax, req.device, req.host, dict(req.device_parts), est.conc, est.bound,
                                  {b: v[0] if v else None for b, v in tr.items()},
                                  {b: v[0] if v else None for b, v in to.items()}))
    return cells


@dataclass(frozen=True)
class PublishedFigure:
    """HiSparse paper (arXiv 2608.07009; read from secondary summaries, performance-anchors.md 'Update 2026-12')."""

    prompt: int = 32768
    output: int = 8192
    concurrency: int = 64
    stock_tok_s: float = 600.0
    hisparse_tok_s: float = 1257.0
    generation_speedup: float = 2.1
    decode_speedup: float = 2.9


# 2 x B200 (HGX/DGX B200: 180 GB HBM3e at 8 TB/s, ~2.25 PFLOP/s dense BF16; the host link is PCIe Gen5 x16 from
# the CPU, ~50 GB/s effective as assumed for H20; 2 TB host DRAM per node).
B200_PAIR = Hardware(n_gpus=2, hbm_gb=180.0, hbm_tbps=8.0, pcie_gbps=50.0, tflops=2250.0, host_ram_gb=2048.0)


@dataclass(frozen=True)
class CheckResult:
    """The model on the published workload: requests it admits, tok/s and the HiSparse/stock ratio, how far that
    ratio is from the published one, and the stock concurrency that the published ratio implies."""

    kv_budget_gb: float
    stock_device_gb: float
    hisparse_device_gb: float
    stock_conc: int
    hisparse_conc: int
    stock_tok_s: float
    hisparse_tok_s: float
    speedup: float
    off_generation: float  # model speedup / published generation speedup - 1
    off_decode: float  # model speedup / published decode-only speedup - 1
    implied_stock_conc: int  # the stock batch whose tok/s is the model's HiSparse tok/s / published ratio
    implied_budget_gb: float  # that batch's KV at the peak context, per GPU
    implied_weights_gb: float  # the total weight bytes that would leave exactly that budget


def check_published(hw: Hardware = B200_PAIR, hs: HiSparseKnobs = HiSparseKnobs(),
                    fig: PublishedFigure = PublishedFigure()) -> CheckResult:
    """Decode of `fig.concurrency` requests at the mean context prompt + output/2; each arm admits as many as fit
    at the peak context prompt + output (the rest wait, as they did in the published stock run's 829 s TTFT)."""
    mean_ctx, peak_ctx = fig.prompt + fig.output // 2, fig.prompt + fig.output
    runs = {}
    for policy in ("stock", "hisparse"):
        peak, fl, sync, extra = _arm(policy, peak_ctx, 1, PolicyKnobs(), hs)
        mean = _arm(policy, mean_ctx, 1, PolicyKnobs(), hs)[0]
        conc = min(fig.concurrency, estimate(peak, fl, hw, sync_pcie=sync, extra_ms=extra).conc_device)
        if conc < 1:
            raise ValueError(f"check_published: no {policy} request of {peak_ctx} tokens fits {hw.hbm_gb} GB")
        st = step_time(conc, mean, fl, hw, sync_pcie=sync, extra_ms=extra)[0]
        runs[policy] = (peak.device, conc, conc / st)
    (s_dev, s_conc, s_tok), (h_dev, h_conc, h_tok) = runs["stock"], runs["hisparse"]
    target = h_tok / fig.generation_speedup
    stock_mean, fl = _arm("stock", mean_ctx, 1, PolicyKnobs(), hs)[:2]
    implied = 1
    while implied < fig.concurrency and implied / step_time(implied, stock_mean, fl, hw)[0] < target:
        implied += 1
    ratio = h_tok / s_tok
    return CheckResult(kv_budget_per_gpu(hw) / 1e9, s_dev / 1e9, h_dev / 1e9, s_conc, h_conc, s_tok, h_tok, ratio,
                       ratio / fig.generation_speedup - 1, ratio / fig.decode_speedup - 1, implied,
                       implied * s_dev / 1e9, hw.n_gpus * (hw.hbm_gb * hw.mem_fraction - implied * s_dev / 1e9))
