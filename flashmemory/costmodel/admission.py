"""What a decode server admits and how fast it decodes, on a hardware preset: sglang's pool sizing per GPU
(`pools`) with the weight shard, FlashMemory's reserve as the plugin sizes it (taken off --mem-fraction-static by
the launch), host DRAM for the mirrors, and the step time (`throughput.step_time`) of each arm. The calibrated model
(`anchors`) and the projections (`projections`) are built on these. A PROJECTION; nothing here is measured.
"""

from __future__ import annotations

import dataclasses

from flashmemory.costmodel.bytes import PolicyKnobs, RequestBytes, baseline_bytes, flashmemory_bytes
from flashmemory.costmodel.disk import DiskKnobs
from flashmemory.costmodel.flops import FlashShape, baseline_flops, flashmemory_flops
from flashmemory.costmodel.hisparse import HiSparseKnobs, hisparse_bytes, swap_kernel_ms
from flashmemory.costmodel.pools import CLIP_MAX_NEW, PoolSizes, Serving, admitted, pool_sizes
from flashmemory.costmodel.presets import Preset
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
