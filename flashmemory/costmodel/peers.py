"""Stock vs HiSparse vs FlashMemory side by side on one decode side (a projection, nothing measured): what each arm
keeps on the device per request, how many requests sglang's pools admit (`anchors.capacity`), and tok/s at a few
batch sizes, at the roofline and with the calibrated fixed per-step overhead.

Arms, per request of `ctx` tokens:
- stock: every KV region on the device; native indexer over the whole history at 21 c4 layers.
- hisparse: `flashmemory.costmodel.hisparse` (hot buffer + full index keys on device; synchronous swap-in and its
  kernel); its token pool priced with `host_to_device_ratio`.
- flashmemory: KMAX pages resident (KMAX scaled as upstream's 96 pages at 256K), Path-I at >= 1M; recall async.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashmemory.costmodel.admission import tok_s
from flashmemory.costmodel.anchors import Fitted, calibrated, calibrated_hisparse, fit, launch_node
from flashmemory.costmodel.anchors import _arm as arm_bytes
from flashmemory.costmodel.hisparse import HiSparseKnobs
from flashmemory.costmodel.presets import Preset
from flashmemory.costmodel.projections import auto_ratio_capacity, kmax_for

PEER_CONTEXTS = (131072, 262144, 1048576)
PEER_BATCHES = (1, 16, 64)
POLICIES = ("stock", "hisparse", "flashmemory")

__all__ = ["PEER_CONTEXTS", "PEER_BATCHES", "POLICIES", "PeerCell", "kmax_for", "peer_table"]


@dataclass(frozen=True)
class PeerCell:
    """One arm at one context: device/host bytes per request (what the request itself occupies; sglang's pool
    reserves by `pools.bytes_per_full_token`), the admitted ceiling and what bounds it, and tok/s (roofline and
    with the fixed per-step overhead) at each batch; None where the batch is not admitted."""

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


def peer_table(
    f: Fitted | None = None,
    hs: HiSparseKnobs | None = None,
    preset: Preset | None = None,
    contexts: tuple[int, ...] = PEER_CONTEXTS,
    batches: tuple[int, ...] = PEER_BATCHES,
) -> list[PeerCell]:
    """Every arm at every context on `preset` calibrated with `f` (default: `fit()`; preset default: this repo's
    8xH20 launch, `anchors.launch_node`), each arm at the smallest SWA ratio for what it admits
    (`anchors.auto_ratio_capacity`); `hs` defaults to sglang's HiSparse defaults with the fitted swap-in kernel
    cost."""
    f = f or fit()
    p = launch_node(f) if preset is None else calibrated(preset, f)
    roof = dataclasses.replace(p, hw=dataclasses.replace(p.hw, overhead_ms=0.0))
    hs = hs or calibrated_hisparse(f)
    cells = []
    for ctx in contexts:
        kmax = kmax_for(ctx)
        for policy in POLICIES:
            req = arm_bytes(policy, ctx, kmax, hs)[0]
            _, conc, bound = auto_ratio_capacity(p, policy, ctx, kmax, hs)
            tr = {b: tok_s(roof, policy, ctx, b, kmax, hs) if b <= conc else None for b in batches}
            to = {b: tok_s(p, policy, ctx, b, kmax, hs) if b <= conc else None for b in batches}
            cells.append(PeerCell(policy, ctx, kmax, req.device, req.host, dict(req.device_parts), conc, bound, tr, to))
    return cells
