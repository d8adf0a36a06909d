"""An ESTIMATE of the decode concurrency ceiling and aggregate throughput on 8xH20 (TP8), from the byte and
FLOP models. Nothing here is measured.

Assumptions (all in `Hardware`, all overridable):
- TP8 with one shared KV head (MQA) and index keys shared by all indexer heads, so every rank holds and
  reads the whole KV of every request (KV is replicated, not split, across the 8 GPUs); FLOPs split 8 ways.
- KV budget per GPU = HBM * mem_fraction - weights / n_gpus; weights from the shapes (routed experts FP4
  with a ue8m0 scale per 32, embedding/head bf16, the rest FP8).
- The host mirror is kept per rank (upstream: "60 x 1M mirrors is about 1.7 TB"), so host bytes x n_gpus.
- Step time = fixed overhead + max(HBM time, compute time); FlashMemory's recall is async (overlapped,
  so PCIe joins the max); HiSparse's misses are synchronous (PCIe time is added).
- Routing is uniform: a batch of B tokens touches 1 - (1 - 6/256)^B of the routed experts per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashmemory.costmodel.bytes import RequestBytes
from flashmemory.costmodel.flops import FlashShape

EXPERT_BYTES = {"fp4": 0.5 + 1 / 32, "fp8": 1.0 + 4 / (128 * 128)}  # bytes per routed-expert weight


@dataclass(frozen=True)
class Hardware:
    n_gpus: int = 8
    hbm_gb: float = 96.0
    hbm_tbps: float = 4.0
    pcie_gbps: float = 50.0
    tflops: float = 148.0  # dense BF16
    mfu: float = 1.0  # fraction of peak reached by decode matmuls (1.0 = roofline)
    mem_fraction: float = 0.80
    weights_gb: float | None = None  # None: computed by weight_bytes()
    host_ram_gb: float = 2265.0
    host_fraction: float = 0.70  # host RAM usable for mirrors (OS, pinned staging, sglang itself take the rest)
    max_running: int = 128  # --max-running-requests in upstream's decode launch
    overhead_ms: float = 0.0  # fixed per-step cost: all-reduces, launches, scheduler (not modelled)
    experts: str = "fp4"  # routed-expert precision of the checkpoint: fp4 (+ scale / 32) or fp8 (ds_fp8)

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_BYTES:
            raise ValueError(f"Hardware.experts must be one of {sorted(EXPERT_BYTES)}, got {self.experts!r}")
        for name in ("n_gpus", "hbm_gb", "hbm_tbps", "pcie_gbps", "tflops", "host_ram_gb", "max_running"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Hardware.{name} must be > 0, got {getattr(self, name)}")
        for name in ("mfu", "mem_fraction", "host_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Hardware.{name} must lie in (0, 1], got {getattr(self, name)}")
        if self.overhead_ms < 0:
            raise ValueError(f"Hardware.overhead_ms must be >= 0, got {self.overhead_ms}")


@dataclass(frozen=True)
class WeightBytes:
    routed: float
    other: float

    @property
    def total(self) -> float:
        return self.routed + self.other


def weight_bytes(s: FlashShape = FlashShape(), experts: str = "fp4") -> WeightBytes:
    """Checkpoint bytes: routed experts FP4 (+1 scale byte / 32) or FP8 (+ an fp32 scale per 128 x 128 block),
    embed + head bf16, everything else FP8."""
    routed = s.n_layers * s.n_experts * 3 * s.hidden * s.moe_inter * EXPERT_BYTES[experts]
    hpg = s.n_heads // s.o_groups
    attn = (
        s.hidden * s.q_lora
        + s.q_lora * s.n_heads * s.head_dim
        + s.hidden * s.head_dim
        + s.o_groups * hpg * s.head_dim * s.o_lora
        + s.o_groups * s.o_lora * s.hidden
    )
    moe_other = s.n_shared * 3 * s.hidden * s.moe_inter + s.hidden * s.n_experts
    c4 = (
        2 * s.hidden * 2 * s.head_dim
        + s.q_lora * s.index_heads * s.index_dim
        + s.hidden * s.index_heads
        + 2 * s.hidden * 2 * s.index_dim
    )
    c128 = 2 * s.hidden * s.head_dim
    other = s.n_layers * (attn + moe_other) + s.n_c4 * c4 + s.n_c128 * c128 + 2 * 2 * s.vocab * s.hidden
    return WeightBytes(routed=routed, other=other)


@dataclass(frozen=True)
class Estimate:
    policy: str
    conc_device: int
    conc_host: int | None
    conc: int
    bound: str
    step_ms: float
    hbm_ms: float
    compute_ms: float
    pcie_ms: float
    tok_s: float


def _weights_per_gpu(hw: Hardware, s: FlashShape) -> tuple[float, float]:
    """(total weight bytes per GPU, routed-expert bytes per GPU)."""
    wb = weight_bytes(s, hw.experts)
    total = hw.weights_gb * 1e9 if hw.weights_gb is not None else wb.total
    scale = total / wb.total
    return total / hw.n_gpus, wb.routed * scale / hw.n_gpus


def kv_budget_per_gpu(hw: Hardware, s: FlashShape = FlashShape()) -> float:
    """HBM bytes per GPU left for KV after the static fraction and the weight shard."""
    budget = hw.hbm_gb * 1e9 * hw.mem_fraction - _weights_per_gpu(hw, s)[0]
    if budget <= 0:
        raise ValueError(f"no HBM left for KV: {hw.hbm_gb} GB x {hw.mem_fraction} minus weights")
    return budget


def step_time(
    batch: int,
    req: RequestBytes,
    flops_per_token: float,
    hw: Hardware,
    s: FlashShape = FlashShape(),
    sync_pcie: bool = False,
    extra_ms: float = 0.0,
) -> tuple[float, float, float, float]:
    """(step, hbm, compute, pcie) seconds for `batch` decoding requests, each like `req`; `extra_ms` is a
    policy's own fixed per-step cost on top of `hw.overhead_ms`."""
    w_total, w_routed = _weights_per_gpu(hw, s)
    touched = 1.0 - (1.0 - s.experts_per_tok / s.n_experts) ** batch
    w_read = w_total - w_routed + w_routed * touched
    hbm = (w_read + batch * req.hbm_read_step) / (hw.hbm_tbps * 1e12)
    compute = batch * flops_per_token / (hw.n_gpus * hw.tflops * 1e12 * hw.mfu)
    pcie = batch * req.pcie_step / (hw.pcie_gbps * 1e9)
    core = max(hbm, compute) + pcie if sync_pcie else max(hbm, compute, pcie)
    return (hw.overhead_ms + extra_ms) * 1e-3 + core, hbm, compute, pcie


def capacity(req: RequestBytes, hw: Hardware, s: FlashShape = FlashShape()) -> tuple[int, int | None]:
    """(requests that fit the HBM KV budget of one GPU, requests whose host mirrors fit host DRAM or None)."""
    dev = math.floor(kv_budget_per_gpu(hw, s) / req.device)
    if req.host <= 0:
        return dev, None
    return dev, math.floor(hw.host_ram_gb * 1e9 * hw.host_fraction / (req.host * hw.n_gpus))


def throughput_at(
    req: RequestBytes,
    flops_per_token: float,
    hw: Hardware,
    batch: int,
    s: FlashShape = FlashShape(),
    sync_pcie: bool = False,
    extra_ms: float = 0.0,
) -> tuple[float, float] | None:
    """(aggregate tok/s, step ms) with `batch` requests like `req` decoding at once; None when they do not fit
    the HBM KV budget or host DRAM (max-running is not applied: the caller picks the batch)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    dev, host = capacity(req, hw, s)
    if batch > dev or (host is not None and batch > host):
        return None
    st = step_time(batch, req, flops_per_token, hw, s, sync_pcie, extra_ms)[0]
    return batch / st, st * 1e3


def estimate(
    req: RequestBytes,
    flops_per_token: float,
    hw: Hardware,
    s: FlashShape = FlashShape(),
    sync_pcie: bool = False,
    extra_ms: float = 0.0,
) -> Estimate:
    """Concurrency ceiling (min of HBM, host DRAM, max-running) and aggregate tok/s at that concurrency."""
    dev, host = capacity(req, hw, s)
    bounds = {"HBM": dev, "max-running": hw.max_running}
    if host is not None:
        bounds["host DRAM"] = host
    bound = min(bounds, key=bounds.get)
    conc = bounds[bound]
    if conc < 1:
        return Estimate(req.policy, dev, host, 0, bound, math.inf, 0.0, 0.0, 0.0, 0.0)
    st, hbm, comp, pcie = step_time(conc, req, flops_per_token, hw, s, sync_pcie, extra_ms)
    return Estimate(req.policy, dev, host, conc, bound, st * 1e3, hbm * 1e3, comp * 1e3, pcie * 1e3, conc / st)
