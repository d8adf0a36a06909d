"""The HiSparse + prefetch arm of the cost model (a projection): sglang's HiSparse with FlashMemory's prefetch
mode (`SGLANG_FLASHMEMORY_HISPARSE_PREFETCH=1`, docs/hisparse.md section 9) on DeepSeek-V4.

HiSparse's step (`costmodel.hisparse`, `anchors.tok_s`): the swap-in of the top-k's misses is on the critical
path (`sync_pcie`: PCIe time adds to max(HBM, compute)), plus its kernel (`swap_kernel_ms`). With the prefetch:
- a share `coverage` of those misses is found already resident (prefetch hits); only the rest is copied on
  demand, still on the critical path;
- the prefetch copies `coverage / precision` times the hit entries (precision = used / loaded), on a side
  stream: off the critical path as long as the PCIe link has room, i.e. while demand + prefetch transfer time
  fits in the step; beyond that the link binds and the step stretches to it;
- the demand swap-in kernel stays (planning and the LRU walk are per step whatever hits), and so do the
  indexer's FLOPs over the whole history (the mode keeps HiSparse exact); Level 1's FLOPs per cycle, amortized
  over tau, are added when `level1` is set. The side-stream kernel's SM time is not priced (it overlaps).
What it cannot change: the indexer FLOPs and index-key reads, and HiSparse's device bytes per request (the hot
buffer is as large as before; a smaller buffer at equal hit rate is what the measured rates would have to show).

`coverage` and `precision` are knobs: no Level-1 hint has run on a HiSparse server yet, so they are inputs of
the projection, not measurements (on CPU the attribution counters `flashmemory_hisparse_prefetch_used/loaded`
give them once a hint runs). `python -m flashmemory.costmodel.hisparse_prefetch` prints the projection table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

from flashmemory.costmodel.anchors import calibrated_hisparse, fit, launch_node
from flashmemory.costmodel.bytes import EntryBytes
from flashmemory.costmodel.flops import FlashShape, baseline_flops, flashmemory_flops
from flashmemory.costmodel.hisparse import HiSparseKnobs, hisparse_bytes, hisparse_swap_tokens, swap_kernel_ms
from flashmemory.costmodel.presets import Preset
from flashmemory.costmodel.projections import auto_ratio_capacity
from flashmemory.costmodel.throughput import step_time

CONTEXTS = (131072, 262144, 524288, 1048576)
HIT_RATES = (0.95, 0.68)  # the cost model's default knob; the CPU run's post-cold-step rate at 750 entries / 512
COVERAGES = (0.5, 0.9)


@dataclass(frozen=True)
class PrefetchKnobs:
    """coverage: share of HiSparse's demand misses that the hint turns into hits; precision: prefetched entries
    used / loaded; level1: add Level 1's FLOPs (amortized over tau) to each step."""

    coverage: float = 0.5
    precision: float = 0.5
    level1: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.coverage <= 1.0:
            raise ValueError(f"PrefetchKnobs.coverage must lie in [0, 1], got {self.coverage}")
        if not 0.0 < self.precision <= 1.0:
            raise ValueError(f"PrefetchKnobs.precision must lie in (0, 1], got {self.precision}")


@dataclass(frozen=True)
class PrefetchStep:
    """One decode step of `batch` requests of `ctx` tokens: HiSparse's and HiSparse + prefetch's step time (ms),
    per-token host -> device bytes on the critical path (demand) and off it (prefetch), and whether the PCIe link
    (not the forward) set the prefetch arm's step."""

    ctx: int
    batch: int
    hisparse_ms: float
    prefetch_ms: float
    demand_bytes: float
    prefetch_bytes: float
    hisparse_demand_bytes: float
    link_bound: bool

    @property
    def speedup(self) -> float:
        return self.hisparse_ms / self.prefetch_ms


def prefetch_step(
    p: Preset,
    ctx: int,
    batch: int,
    hs: HiSparseKnobs,
    pk: PrefetchKnobs,
    s: FlashShape = FlashShape(),
    e: EntryBytes = EntryBytes(),
) -> PrefetchStep:
    """Step times of both arms on preset `p` (see the module docstring for the model)."""
    req = hisparse_bytes(ctx, hs, s)
    swap = hisparse_swap_tokens(ctx, hs, s) * e.kv  # demand H2D bytes per request per step
    backup = req.pcie_step - swap
    extra = swap_kernel_ms(batch, ctx, hs, p.n_sm, s) + hs.step_overhead_ms
    base_flops = baseline_flops(ctx, s).total
    hisparse = step_time(batch, req, base_flops, p.hw, s, sync_pcie=True, extra_ms=extra)[0]
    demand = swap * (1.0 - pk.coverage)
    pf = swap * pk.coverage / pk.precision
    flops = base_flops + (flashmemory_flops(ctx, 1, s).level1 if pk.level1 else 0.0)
    fwd = step_time(
        batch, dataclasses.replace(req, pcie_step=demand + backup), flops, p.hw, s, sync_pcie=True, extra_ms=extra
    )
    link = (p.hw.overhead_ms + extra) * 1e-3 + fwd[3] + batch * pf / (p.hw.pcie_gbps * 1e9)
    return PrefetchStep(ctx, batch, hisparse * 1e3, max(fwd[0], link) * 1e3, demand, pf, swap, link > fwd[0])


def projection(
    p: Preset | None = None,
    hit_rates: tuple[float, ...] = HIT_RATES,
    coverages: tuple[float, ...] = COVERAGES,
    precision: float = 0.5,
) -> list[PrefetchStep]:
    """Both arms at HiSparse's admitted concurrency (sglang's sizing at the smallest SWA ratio for it,
    `anchors.auto_ratio_capacity`) on this repo's 8xH20 launch as `flashmemory bench costmodel --anchors` projects
    it, for each context, hit rate and coverage (in that order)."""
    f = fit()
    p = p or launch_node(f)
    out = []
    for ctx in CONTEXTS:
        for hit in hit_rates:
            hs = calibrated_hisparse(f, hit_rate=hit)
            n = auto_ratio_capacity(p, "hisparse", ctx, 1, hs)[1]
            for cov in coverages:
                out.append(prefetch_step(p, ctx, max(n, 1), hs, PrefetchKnobs(cov, precision)))
    return out


def table(
    rows: list[PrefetchStep], hit_rates: tuple[float, ...] = HIT_RATES, coverages: tuple[float, ...] = COVERAGES
) -> str:
    """Markdown table of `projection()` rows (same order)."""
    lines = [
        "| context | HiSparse hit rate | coverage | batch | HiSparse step ms | + prefetch step ms | speed-up | "
        "demand H2D KB/token | prefetch KB/token | PCIe binds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    keys = [(h, c) for _ in CONTEXTS for h in hit_rates for c in coverages]
    for r, (h, c) in zip(rows, keys):
        lines.append(
            f"| {r.ctx // 1024}K | {h:.2f} | {c:.1f} | {r.batch} | {r.hisparse_ms:.1f} | "
            f"{r.prefetch_ms:.1f} | "
            f"{r.speedup:.2f} | {r.demand_bytes / 1e3:.0f} | {r.prefetch_bytes / 1e3:.0f} | "
            f"{'yes' if r.link_bound else 'no'} |"
        )
    return "\n".join(lines)


def _rates(raw: str) -> tuple[float, ...]:
    """Comma-separated numbers in (0, 1]."""
    try:
        vals = tuple(float(x) for x in raw.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected comma-separated numbers in (0, 1]") from None
    if not all(0 < v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{raw!r}: every value must lie in (0, 1]")
    return vals


def main(argv: list[str] | None = None) -> int:
    """Print the projection table; flags choose the hit rates, coverages and precision (bad values: argparse's
    one line naming the flag, exit 2)."""
    ap = argparse.ArgumentParser(
        prog="python -m flashmemory.costmodel.hisparse_prefetch",
        description="HiSparse + FlashMemory prefetch on 8xH20, projected by the cost model",
    )
    ap.add_argument("--hit-rates", type=_rates, default=HIT_RATES, help="HiSparse hit rates (default 0.95,0.68)")
    ap.add_argument("--coverages", type=_rates, default=COVERAGES, help="shares of misses prefetched (0.5,0.9)")
    ap.add_argument("--precision", type=_rates, default=(0.5,), help="prefetched entries used / loaded (0.5)")
    a = ap.parse_args(argv)
    if len(a.precision) != 1:
        ap.error("argument --precision: one value")
    print(
        "8xH20 decode, DeepSeek-V4-Flash shape, HiSparse at sglang's default buffer (4,096 slots) and its admitted "
        f"concurrency; prefetch precision {a.precision[0]:g}, Level 1 FLOPs included (projected)"
    )
    rows = projection(hit_rates=a.hit_rates, coverages=a.coverages, precision=a.precision[0])
    print(table(rows, a.hit_rates, a.coverages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
