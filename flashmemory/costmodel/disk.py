"""The disk arm of the cost model: FlashMemory with c4 KV (+ Path-I index-K) pages on local NVMe below
a host-DRAM page cache, against host-DRAM-only FlashMemory and HiSparse. An ESTIMATE; nothing here is measured.

What the model assumes (all in `DiskKnobs` / `PolicyKnobs` / `Hardware`, all overridable):
- The full history lives on disk: `copies` stores per node (default one per rank, n_gpus, what `PageStore` does
  today, since the KV is replicated across TP ranks; 1 = a node-shared store, not built). Disk capacity per node
  = drives x drive_tb x disk_fraction.
- Host DRAM (host_ram_gb x host_fraction) becomes the page cache over all copies. Its hit rate for a recalled page
  is the share of the history it holds (`min(1, cache / (conc x history x copies))`, i.e. recalls land uniformly
  on the history; Level 1's picks are not uniform, so this is neither a best nor a worst case) unless
  `hit_rate` is given.
- Per Level-1 cycle each request recalls `turnover x KMAX` pages per copy (`flashmemory_bytes(...).recall_cycle`);
  the misses are read from disk. Pages written behind: new requests land their whole history (PD), at one
  admission per `output_tokens` decode steps per slot, of which the share not held by the cache goes to disk;
  decode appends are negligible (1/4 chunk per step) and left out.
- Disk time per cycle = reads / (drives x read_gbps x efficiency) + writes / (drives x write_gbps x efficiency);
  reads are issued at the start of the cycle (read-ahead of Level 1's picks) and must land within the window
  tau x step. If they fit, the disk costs nothing; if not, a step waits for them: step = max(step, disk / tau).
  CPU time of the I/O, PCIe contention with the recall's H2D copies, and drive latency tails are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashmemory.costmodel.bytes import PolicyKnobs, flashmemory_bytes
from flashmemory.costmodel.flops import FlashShape, RetrieverShape, flashmemory_flops
from flashmemory.costmodel.throughput import Hardware, capacity, step_time


@dataclass(frozen=True)
class DiskKnobs:
    """Per-node NVMe array and workload assumptions of the disk arm (see the module docstring)."""

    drives: int = 4
    read_gbps: float = 6.5  # per drive, datasheet sequential read (PCIe Gen4 x4 class)
    write_gbps: float = 3.5  # per drive, datasheet sequential write
    efficiency: float = 0.8  # share of datasheet bandwidth reached with ~1-MB page reads at queue depth
    drive_tb: float = 7.68
    disk_fraction: float = 0.9
    copies: int | None = None  # stores per node: None = one per rank (Hardware.n_gpus); 1 = node-shared
    output_tokens: int = 8192  # decode length per request: sets the admission (write) rate
    hit_rate: float | None = None  # host-cache hit rate of recalled pages; None = cache share of the history

    def __post_init__(self) -> None:
        for name in ("drives", "read_gbps", "write_gbps", "drive_tb", "output_tokens"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"DiskKnobs.{name} must be > 0, got {v}")
        for name in ("efficiency", "disk_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"DiskKnobs.{name} must lie in (0, 1], got {getattr(self, name)}")
        if self.copies is not None and self.copies < 1:
            raise ValueError(f"DiskKnobs.copies must be >= 1 or None, got {self.copies}")
        if self.hit_rate is not None and not 0 <= self.hit_rate <= 1:
            raise ValueError(f"DiskKnobs.hit_rate must lie in [0, 1], got {self.hit_rate}")

    def n_copies(self, hw: Hardware) -> int:
        return self.copies if self.copies is not None else hw.n_gpus

    @property
    def read_bps(self) -> float:
        return self.drives * self.read_gbps * 1e9 * self.efficiency

    @property
    def write_bps(self) -> float:
        return self.drives * self.write_gbps * 1e9 * self.efficiency

    @property
    def disk_bytes(self) -> float:
        return self.drives * self.drive_tb * 1e12 * self.disk_fraction


@dataclass(frozen=True)
class DiskPoint:
    """FlashMemory + disk tier at one concurrency, next to host-DRAM-only FlashMemory at the same concurrency.

    fits: HBM, disk capacity and max-running admit `conc`; dram_cap: requests whose per-rank mirrors host DRAM
    holds without a disk tier (None: no host bytes); dram_fits: conc <= dram_cap; step_dram_ms / tok_s_dram: the
    DRAM-only arm at `conc` (as if DRAM were large enough when it is not); loss = 1 - tok_s / tok_s_dram."""

    conc: int
    fits: bool
    bound: str
    dram_cap: int | None
    dram_fits: bool
    hit_rate: float
    read_gb_cycle: float
    write_gb_cycle: float
    disk_ms_cycle: float
    window_ms: float
    window_share: float
    step_dram_ms: float
    step_ms: float
    tok_s_dram: float
    tok_s: float
    loss: float


def disk_point(
    ctx: int,
    kmax: int,
    conc: int,
    hw: Hardware,
    dk: DiskKnobs = DiskKnobs(),
    knobs: PolicyKnobs = PolicyKnobs(path_i=True),
    s: FlashShape = FlashShape(),
    r: RetrieverShape = RetrieverShape(),
    pool_cap: int | None = None,
) -> DiskPoint:
    """The disk arm at `conc` requests of `ctx` tokens (KMAX pages resident each); see the module docstring.
    `pool_cap`: the requests sglang's token pool admits (`anchors.capacity`), in place of the HBM bound computed
    from the bytes one request occupies."""
    if conc < 1:
        raise ValueError(f"conc must be >= 1, got {conc}")
    req = flashmemory_bytes(ctx, kmax, knobs, s, r)
    flops = flashmemory_flops(ctx, kmax, s, r).total
    dev, host_cap = capacity(req, hw, s)
    copies = dk.n_copies(hw)
    history = req.host * copies  # bytes on disk per request, all copies
    disk_cap = math.floor(dk.disk_bytes / history)
    bounds = {"HBM": dev, "disk": disk_cap, "max-running": hw.max_running}
    if pool_cap is not None:
        del bounds["HBM"]
        bounds["token pool"] = pool_cap
    bound = min(bounds, key=bounds.get)
    cache = hw.host_ram_gb * 1e9 * hw.host_fraction
    hit = dk.hit_rate if dk.hit_rate is not None else min(1.0, cache / (conc * history))
    reads = conc * copies * req.recall_cycle * (1.0 - hit)
    writes = conc / dk.output_tokens * r.interval * history * (1.0 - hit)
    disk_s = reads / dk.read_bps + writes / dk.write_bps
    st = step_time(conc, req, flops, hw, s)[0]
    window = r.interval * st
    step = max(st, disk_s / r.interval)
    return DiskPoint(
        conc,
        conc <= bounds[bound],
        bound,
        host_cap,
        host_cap is None or conc <= host_cap,
        hit,
        reads / 1e9,
        writes / 1e9,
        disk_s * 1e3,
        window * 1e3,
        disk_s / window,
        st * 1e3,
        step * 1e3,
        conc / st,
        conc / step,
        1.0 - st / step,
    )


def max_conc_within(
    ctx: int,
    kmax: int,
    hw: Hardware,
    dk: DiskKnobs = DiskKnobs(),
    loss: float = 0.10,
    knobs: PolicyKnobs = PolicyKnobs(path_i=True),
    pool_cap: int | None = None,
) -> int:
    """Largest admitted concurrency whose throughput loss against DRAM-only stays <= `loss` (0 if none).

    The loss grows with conc (more reads per cycle and a colder cache), so the scan stops at the first miss."""
    best = 0
    for c in range(1, hw.max_running + 1):
        p = disk_point(ctx, kmax, c, hw, dk, knobs, pool_cap=pool_cap)
        if not p.fits or p.loss > loss:
            break
        best = c
    return best
