"""The calibrated cost model: the hardware presets of `presets.py` set up with four fitted constants (each fitted
on one published figure, never refitted), every published anchor the model can be set up for (published figure,
model figure, ratio, fit or held out), and the 8xH20 projections made with the same constants. An ESTIMATE;
nothing here is measured.

Model per decode server: sglang's pool sizing (`pools`) decides how many requests are admitted; the step time is
`throughput.step_time` (weights + KV reads over HBM, FLOPs, PCIe; HiSparse's PCIe and swap-in kernel synchronous)
plus a fixed per-step overhead; tok/s = admitted batch / step. Only the decode GPUs count: with prefill/decode
disaggregation `Preset.hw.n_gpus` is the decode side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashmemory.costmodel.bytes import PolicyKnobs, RequestBytes, baseline_bytes, flashmemory_bytes
from flashmemory.costmodel.disk import DiskKnobs
from flashmemory.costmodel.flops import FlashShape, baseline_flops, flashmemory_flops
from flashmemory.costmodel.hisparse import HiSparseKnobs, hisparse_bytes, swap_kernel_ms
from flashmemory.costmodel.pools import (
    CLIP_MAX_NEW,
    PoolSizes,
    Serving,
    admitted,
    bytes_per_full_token,
    fixed_bytes,
    full_need,
    padded_bytes_per_token,
    pool_sizes,
)
from flashmemory.costmodel.presets import B200_PD, H20_LAUNCH, H20_NODE, RTX6000_NODE, Preset
from flashmemory.costmodel.throughput import Hardware, step_time, weight_bytes


def _weights_per_gpu(hw: Hardware, dp: int = 1) -> float:
    """The weight shard per GPU: everything split over the GPUs, except that attention data parallelism replicates
    the non-expert weights on each of the `dp` ranks' GPUs (routed experts stay sharded)."""
    if hw.weights_gb is not None:
        return hw.weights_gb * 1e9 / hw.n_gpus
    wb = weight_bytes(experts=hw.experts)
    return wb.routed / hw.n_gpus + wb.other / (hw.n_gpus // dp)


def sized(p: Preset, sv: Serving | None = None) -> PoolSizes:
    """One GPU's pools on preset `p` launched with `sv` (default: the preset's serving)."""
    sv = sv or p.serving
    return pool_sizes(p.hw.hbm_gb * 1e9, _weights_per_gpu(p.hw, sv.dp), p.hw.n_gpus, sv)


@dataclass(frozen=True)
class Fitted:
    """The four fitted constants: name -> (value, unit, the one published figure it was fitted on)."""

    mem_fraction: float
    host_fraction: float
    overhead_ms: float
    swap_layer_us: float

    def rows(self) -> list[tuple[str, str, str]]:
        return [
            (
                "mem_fraction (8xH20 decode)",
                f"{self.mem_fraction:.3f}",
                "upstream README: stock 47 concurrent at 256K (token pool set to 47.5 x 262,144 tokens)",
            ),
            (
                "host_fraction (8xH20)",
                f"{self.host_fraction:.3f}",
                "upstream README: FlashMemory's 1M ceiling ~40 (KMAX 96), 'bounded by host DRAM' (per-rank mirrors)",
            ),
            (
                "overhead_ms per decode step",
                f"{self.overhead_ms:.2f}",
                "upstream README: stock 256K, 47 concurrent at 1,584 tok/s (step 29.7 ms) minus the model's roofline",
            ),
            (
                "HiSparse swap_layer_us",
                f"{self.swap_layer_us:.0f}",
                "HiSparse paper: 7-8 ms added per token at low concurrency (7.5 ms / 21 c4 layers)",
            ),
        ]


UP_CTX = {"256K": 262144, "512K": 524288, "1M": 1048576}
UP_STOCK = {"256K": (47, 1584.0), "512K": (25, 1028.0), "1M": (11, 455.0)}
UP_FM = {"256K": (96, 76, 2759.0), "512K": (192, 60, 2008.0), "1M": (384, 30, 1266.0)}
UP_FM_1M_K96 = (96, 40, 1537.0)
HISPARSE_LOW_CONC_MS = 7.5  # HiSparse paper: 7-8 ms added per token at low concurrency


def _arm(policy: str, ctx: int, kmax: int, hs: HiSparseKnobs) -> tuple[RequestBytes, float, bool]:
    if policy == "stock":
        return baseline_bytes(ctx), baseline_flops(ctx).total, False
    if policy == "hisparse":
        return hisparse_bytes(ctx, hs), baseline_flops(ctx).total, True
    if policy in ("flashmemory", "flashmemory-nocredit", "disk"):
        return (
            flashmemory_bytes(ctx, kmax, PolicyKnobs(path_i=ctx >= 1048576)),
            flashmemory_flops(ctx, kmax).total,
            False,
        )
    raise ValueError(f"unknown policy {policy!r}")


def tok_s(p: Preset, policy: str, ctx: int, batch: int, kmax: int = 1, hs: HiSparseKnobs = HiSparseKnobs()) -> float:
    """Aggregate decode tok/s of `batch` requests of `ctx` tokens (capacity not checked: see `capacity`)."""
    req, fl, sync = _arm(policy, ctx, kmax, hs)
    extra = swap_kernel_ms(batch, ctx, hs, p.n_sm) if policy == "hisparse" else 0.0
    return (
        batch
        / step_time(
            batch,
            req,
            fl,
            p.hw,
            sync_pcie=sync,
            extra_ms=extra + (hs.step_overhead_ms if policy == "hisparse" else 0.0),
        )[0]
    )


DECODE_REGION_PAGES = 8  # SGLANG_PATHP_DECODE_RESIDENT_CHUNKS 512 / 64 chunks per page
KV_PAGE_BYTES = 64 * 585  # one c4 page of 64 padded 585-B slots (37,440 B)
INDEX_PAGE_BYTES = 64 * 132  # one index-key page (8,448 B)


def fm_reserve_bytes(
    target_conc: int, kmax: int, decode_max_conc: int = 128, path_i: bool = False, s: FlashShape = FlashShape()
) -> float:
    """Device bytes of FlashMemory's reserve as the plugin sizes it (`geometry.reserve_bytes`): (TGT_CONC x
    (KMAX + 1) recall blocks + DECODE_MAX_CONC decode regions of 8 pages + 1 sink) page blocks, each one c4 KV page
    at every c4 layer (+ the index pages of the 18 non-retriever layers with Path-I). Launch defaults (TGT_CONC 60,
    KMAX 96, DECODE_MAX_CONC 128): 5.38 GB (5,381,812,800 B)."""
    blocks = target_conc * (kmax + 1) + decode_max_conc * DECODE_REGION_PAGES + 1
    return blocks * (s.n_c4 * KV_PAGE_BYTES + (s.n_c4 - 3 if path_i else 0) * INDEX_PAGE_BYTES)


def fm_admitted(
    p: Preset, ctx: int, kmax: int, max_new: int = CLIP_MAX_NEW, path_i: bool | None = None
) -> tuple[int, str, Serving]:
    """(requests, what binds, the serving it needs) for FlashMemory with CREDIT_C4=1 launched as launch_decode.sh
    does: TGT_CONC set to the requests it admits and --mem-fraction-static lowered by the reserve that TGT_CONC
    sizes. The largest n whose pools still admit n after their own reserve is taken (a larger TGT_CONC only
    shrinks the pool)."""
    pi = ctx >= 1048576 if path_i is None else path_i

    def sv_for(n: int) -> Serving:
        return dataclasses.replace(
            p.serving, credit_c4=True, reserve_bytes=fm_reserve_bytes(n, kmax, p.serving.max_running, pi)
        )

    def at(n: int) -> tuple[int, str]:
        sv = sv_for(n)
        return admitted(sized(p, sv), ctx, sv, max_new=max_new)

    lo, hi = 0, p.serving.running_per_rank
    while lo < hi:  # the largest n with at(n) >= n
        mid = (lo + hi + 1) // 2
        if at(mid)[0] >= mid:
            lo = mid
        else:
            hi = mid - 1
    if lo == p.serving.running_per_rank:
        return lo, "max-running", sv_for(lo)
    bound = at(lo + 1)[1]  # what stops one more request (its reserve row included)
    return lo, bound, sv_for(max(lo, 1))


def capacity(
    p: Preset, policy: str, ctx: int, kmax: int = 1, hs: HiSparseKnobs = HiSparseKnobs(), dk: DiskKnobs = DiskKnobs()
) -> tuple[int, str]:
    """(requests admitted at once per attention rank x DP ranks, what binds) for one arm, from sglang's sizing plus
    host DRAM (per-rank copies); the disk arm is FlashMemory with the history on `dk`'s drives instead of host
    DRAM (one copy per rank). 'flashmemory' is launched with CREDIT_C4=1 (the token pool priced without c4 KV,
    --mem-fraction-static lowered by the reserve that TGT_CONC sizes: `fm_admitted`); 'flashmemory-nocredit' is
    the launch default CREDIT_C4=0: the token pool, so the admission, stays stock's."""
    dp = p.serving.dp
    if policy == "stock":
        n, bound = admitted(sized(p), ctx, p.serving)
        return n * dp, bound
    if policy == "hisparse":
        sv = dataclasses.replace(p.serving, hisparse_ratio=hs.host_to_device_ratio)
        n, bound = admitted(sized(p, sv), ctx, sv, hisparse_slots=hs.padded_slots)
        host = hisparse_bytes(ctx, hs).host
    elif policy == "flashmemory-nocredit":
        n, bound = admitted(sized(p), ctx, p.serving)
        host = _arm(policy, ctx, kmax, hs)[0].host
    elif policy in ("flashmemory", "disk"):
        n, bound, _ = fm_admitted(p, ctx, kmax)
        host = _arm(policy, ctx, kmax, hs)[0].host
        if policy == "disk":
            disk_cap = int(dk.disk_bytes // (host * dk.n_copies(p.hw)))
            return (disk_cap, "disk") if disk_cap < n * dp else (n * dp, bound)
    else:
        raise ValueError(f"unknown policy {policy!r}")
    n *= dp
    copies = p.hw.n_gpus // dp  # every TP rank of an attention group mirrors its group's requests
    host_cap = int(p.hw.host_ram_gb * 1e9 * p.hw.host_fraction // (host * copies))
    return (host_cap, "host DRAM") if host_cap < n else (n, bound)


def fit(h20: Preset = H20_NODE) -> Fitted:
    """Fit the four constants, each on its one anchor (see `Fitted.rows`). A published concurrency n is read as
    a pool of n + 0.5 requests (the middle of the range that admits exactly n)."""
    ctx = UP_CTX["256K"]
    conc, tps = UP_STOCK["256K"]
    pool_bytes = (conc + 0.5) * full_need(1, ctx, h20.serving) * bytes_per_full_token(h20.serving)
    frac = (pool_bytes + fixed_bytes(h20.serving) + _weights_per_gpu(h20.hw)) / (h20.hw.hbm_gb * 1e9)
    fm_host = _arm("flashmemory", UP_CTX["1M"], UP_FM_1M_K96[0], HiSparseKnobs())[0].host
    host_frac = (UP_FM_1M_K96[1] + 0.5) * fm_host * h20.hw.n_gpus / (h20.hw.host_ram_gb * 1e9)
    roof = step_time(conc, baseline_bytes(ctx), baseline_flops(ctx).total, dataclasses.replace(h20.hw, overhead_ms=0))[
        0
    ]
    overhead = 1e3 * (conc / tps - roof)
    return Fitted(round(frac, 4), round(host_frac, 4), overhead, HISPARSE_LOW_CONC_MS * 1e3 / FlashShape().n_c4)


def calibrated(p: Preset, f: Fitted, fitted_memory: bool = False) -> Preset:
    """`p` with the fitted overhead (and, for upstream's own 8xH20 servers, its fitted memory/host fractions)."""
    hw = dataclasses.replace(
        p.hw, overhead_ms=f.overhead_ms, host_fraction=f.host_fraction if fitted_memory else p.hw.host_fraction
    )
    sv = dataclasses.replace(p.serving, mem_fraction=f.mem_fraction) if fitted_memory else p.serving
    return dataclasses.replace(p, hw=hw, serving=sv)


def launch_node(f: Fitted, preset: Preset = H20_LAUNCH) -> Preset:
    """This repo's 8xH20 decode launch: the fitted per-step overhead and host fraction (both about the node, not
    the launch), sglang's own --mem-fraction-static formula and ratio-mode SWA, FP8 experts."""
    p = calibrated(preset, f)
    return dataclasses.replace(p, hw=dataclasses.replace(p.hw, host_fraction=f.host_fraction))


def calibrated_hisparse(f: Fitted, **kw: object) -> HiSparseKnobs:
    return HiSparseKnobs(swap_layer_us=f.swap_layer_us, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Anchor:
    """One published figure next to the model's: `use` is 'fit' or 'held out'; `lacks` says what the model
    cannot represent when the ratio falls outside the claimed tolerance."""

    name: str
    setting: str
    published: float
    model: float
    use: str
    source: str
    lacks: str = ""

    @property
    def ratio(self) -> float:
        return self.model / self.published


TOLERANCE = 0.20


def anchors(f: Fitted | None = None) -> list[Anchor]:
    """Every anchor the model can be set up for, computed with the constants of `fit()` and nothing refitted."""
    f = f or fit()
    out: list[Anchor] = []
    up = calibrated(H20_NODE, f, fitted_memory=True)
    src = "upstream FlashMemory README (seeds), 8xH20 TP8, cross-machine PD"
    for lab, ctx in UP_CTX.items():
        conc, tps = UP_STOCK[lab]
        out.append(
            Anchor(
                f"stock concurrency {lab}",
                up.name,
                conc,
                capacity(up, "stock", ctx)[0],
                "fit" if lab == "256K" else "held out",
                src,
            )
        )
        out.append(
            Anchor(
                f"stock tok/s {lab} @ {conc}",
                up.name,
                tps,
                tok_s(up, "stock", ctx, conc),
                "fit" if lab == "256K" else "held out",
                src,
            )
        )
    for lab, (kmax, conc, tps) in UP_FM.items():
        out.append(
            Anchor(
                f"FlashMemory tok/s {lab} KMAX {kmax} @ {conc}",
                up.name,
                tps,
                tok_s(up, "flashmemory", UP_CTX[lab], conc, kmax),
                "held out",
                src,
            )
        )
    kmax, conc, tps = UP_FM_1M_K96
    out.append(
        Anchor(
            "FlashMemory 1M ceiling KMAX 96",
            up.name,
            conc,
            capacity(up, "flashmemory", UP_CTX["1M"], kmax)[0],
            "fit",
            src,
        )
    )
    out.append(
        Anchor(
            f"FlashMemory tok/s 1M KMAX 96 @ {conc}",
            up.name,
            tps,
            tok_s(up, "flashmemory", UP_CTX["1M"], conc, kmax),
            "held out",
            src,
        )
    )
    ratio = tok_s(up, "flashmemory", UP_CTX["1M"], 30, 384) / tok_s(up, "stock", UP_CTX["1M"], 11)
    out.append(Anchor("FlashMemory / stock tok/s at 1M (30 vs 11)", up.name, 2.8, ratio, "held out", src))
    out += _hisparse_paper(f) + _pr33075(f)
    return out


def _hisparse_paper(f: Fitted) -> list[Anchor]:
    p, hs = calibrated(B200_PD, f), calibrated_hisparse(f)
    peak, mean, conc = 32768 + 8192, 32768 + 4096, 64
    src = "HiSparse paper (arXiv 2608.07009, secondary summaries; performance-anchors.md)"
    cs, ch = (min(conc, capacity(p, pol, peak, hs=hs)[0]) for pol in ("stock", "hisparse"))
    ts, th = tok_s(p, "stock", mean, cs), tok_s(p, "hisparse", mean, ch, hs=hs)
    lacks = (
        f"in sglang's sizing one B200 admits {capacity(p, 'stock', peak)[0]} stock requests of {peak} tokens "
        "(not capacity-bound at 64), so HiSparse only adds its swap-in; the paper's stock launch (memory "
        "fraction, max-running, PD split) is not public, and its generation figure includes prefill and queueing"
    )
    c128 = 21 * 32768 * padded_bytes_per_token(4)
    hot = 21 * (1024 + 64) * padded_bytes_per_token(4)
    return [
        Anchor("decode-only HiSparse / stock, 64 concurrent", p.name, 2.9, th / ts, "held out", src, lacks),
        Anchor("generation HiSparse / stock, 64 concurrent", p.name, 2.1, th / ts, "held out", src, lacks),
        Anchor(
            "stock generation tok/s",
            p.name,
            600.0,
            ts,
            "held out",
            src,
            "the published figure is output tokens over the whole run (prefill, queueing: TTFT 829 s); the "
            "model gives steady decode tok/s",
        ),
        Anchor(
            "HBM per 128K request: c4 KV, stock / HiSparse (buffer 2 x top-k)",
            "DSv4-Flash geometry",
            30.0,
            c128 / hot,
            "held out",
            src,
        ),
    ]


def _pr33075(f: Fitted) -> list[Anchor]:
    p, hs = calibrated(RTX6000_NODE, f), calibrated_hisparse(f)
    ctx = 32768 + 1024
    src = "sglang PR #33075 (third party), 8xRTX PRO 6000, 32K in / 2K out"
    out = []
    for batch, pub in ((1, 0.92), (2, 0.92), (8, 1.19), (32, 2.43), (54, 3.00)):
        r = tok_s(p, "hisparse", ctx, batch, hs=hs) / tok_s(p, "stock", ctx, batch)
        lacks = (
            ""
            if pub <= 1
            else (
                f"above 1 HiSparse must admit more than stock; in sglang's sizing this node holds "
                f"{capacity(p, 'stock', ctx)[0]} stock requests, so the model keeps the ratio below 1: the PR's "
                f"stock launch flags are not public"
            )
        )
        out.append(Anchor(f"HiSparse / stock at batch {batch}", p.name, pub, r, "held out", src, lacks))
    return out
