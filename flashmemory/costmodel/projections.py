"""8xH20 projections of the calibrated cost model (`anchors`): every arm's admitted concurrency and tok/s at 128K,
256K and 1M on this repo's decode launch, each arm at the smallest --swa-full-tokens-ratio for what its pools admit
(what launch_decode.sh's SWA_RATIO=auto passes), beside its concurrency at sglang's DeepSeek-V4 default 0.1. A
PROJECTION; nothing here is measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flashmemory.costmodel.admission import capacity, tok_s
from flashmemory.costmodel.anchors import Fitted, calibrated_hisparse, fit, launch_node
from flashmemory.costmodel.disk import DiskKnobs
from flashmemory.costmodel.hisparse import HiSparseKnobs
from flashmemory.costmodel.pools import SGLANG_SWA_RATIO, auto_swa_ratio
from flashmemory.costmodel.presets import Preset

CONTEXTS = (131072, 262144, 1048576)
ARMS = ("stock", "hisparse", "flashmemory-nocredit", "flashmemory", "disk")


def kmax_for(ctx: int) -> int:
    """Upstream's residency: 96 pages at 256K, scaled with the context."""
    return max(1, round(ctx * 96 / 262144))


def with_swa_ratio(p: Preset, ratio: float | None) -> Preset:
    return dataclasses.replace(p, serving=dataclasses.replace(p.serving, swa_ratio=ratio))


def auto_ratio_capacity(
    p: Preset, arm: str, ctx: int, kmax: int = 1, hs: HiSparseKnobs = HiSparseKnobs(), dk: DiskKnobs = DiskKnobs()
) -> tuple[float, int, str]:
    """(ratio, requests, what binds) for `arm` launched with the smallest --swa-full-tokens-ratio for what its
    pools admit (`pools.auto_swa_ratio`; launch_decode.sh's SWA_RATIO=auto with TGT_CONC set to that)."""
    ratio, _ = auto_swa_ratio(
        lambda r: capacity(with_swa_ratio(p, r), arm, ctx, kmax, hs, dk)[0] // p.serving.dp,
        p.serving.running_per_rank,
        ctx,
        p.serving,
    )
    n, bound = capacity(with_swa_ratio(p, ratio), arm, ctx, kmax, hs, dk)
    return ratio, n, bound


def projections(
    f: Fitted | None = None,
    hs: HiSparseKnobs | None = None,
    preset: Preset | None = None,
    disk_tok_s: Callable[[Preset, int, int, int], float] | None = None,
) -> list[dict]:
    """Max concurrency (and what binds) and tok/s there for every arm at 128K, 256K, 1M on `preset` (default:
    this repo's 8xH20 launch, `launch_node`), each arm launched with the smallest --swa-full-tokens-ratio for what
    its pools admit (`pools.auto_swa_ratio`, what launch_decode.sh passes); `conc_sglang` is the concurrency at
    sglang's DeepSeek-V4 default ratio 0.1. The disk arm is FlashMemory without the host-DRAM bound;
    `disk_tok_s(preset, ctx, kmax, conc)` prices its reads (default: FlashMemory's tok/s, i.e. disk reads hidden
    in the recall window)."""
    f = f or fit()
    p = preset or launch_node(f)
    hs = hs or calibrated_hisparse(f)
    rows = []
    for ctx in CONTEXTS:
        kmax = kmax_for(ctx)
        for arm in ARMS:
            ratio, n, bound = auto_ratio_capacity(p, arm, ctx, kmax, hs)
            n01 = capacity(with_swa_ratio(p, SGLANG_SWA_RATIO), arm, ctx, kmax, hs)[0]
            if n < 1:
                t = 0.0
            elif arm == "disk" and disk_tok_s is not None:
                t = disk_tok_s(p, ctx, kmax, n)
            else:
                t = tok_s(p, "flashmemory" if arm.startswith(("disk", "flashmemory")) else arm, ctx, n, kmax, hs)
            rows.append(
                {
                    "ctx": ctx,
                    "arm": arm,
                    "kmax": kmax,
                    "conc": n,
                    "bound": bound,
                    "tok_s": t,
                    "swa_ratio": ratio,
                    "conc_sglang": n01,
                }
            )
    return rows
