"""Per-request KV bytes (device / host), per-step HBM reads and PCIe traffic for stock and FlashMemory.

- baseline: every KV region on the GPU; the indexer reads all index keys every step.
- flashmemory: c4 KV resident only for KMAX*64 chunks (one global resident set shared by all 21 c4
  layers); full c4 mirror on host. Index keys: all 21 layers on GPU, or with Path-I only the 3 retriever
  layers in full plus the resident chunks of the other 18 (their full copy on host). Level 2 reads only
  resident index keys; Level 1 reads the retriever layers' full index keys once per tau.
- hisparse: sglang's own HiSparse, in `flashmemory.costmodel.hisparse` (its hot buffer is sized by
  --hisparse-config, not by KMAX).

Entry sizes (sglang 0.5.23 DSv4 pools): c4/c128/SWA KV 584 B (448 fp8 nope + 128 bf16 rope + 7 scales
+ 1 pad), index key 132 B (128 fp8 + fp32 scale). Every layer keeps its own 128-token SWA ring.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashmemory.costmodel.flops import FlashShape, RetrieverShape, n_chunks, resident_chunks


@dataclass(frozen=True)
class EntryBytes:
    kv: int = 584
    index_key: int = 132


@dataclass(frozen=True)
class PolicyKnobs:
    """Assumptions that are not in any config. Defaults are worst cases unless stated."""

    path_i: bool = False  # offload the 18 non-retriever layers' index keys (upstream needs it at 1M)
    turnover: float = 1.0  # fraction of the resident set replaced per Level-1 cycle (1.0 = worst case)


@dataclass(frozen=True)
class RequestBytes:
    """Bytes for one request of `ctx` tokens; `*_step` are per decode step, `recall_cycle` per Level-1 cycle."""

    policy: str
    device: float
    host: float
    hbm_read_step: float
    pcie_step: float
    recall_cycle: float
    device_parts: dict[str, float]


def _regions(ctx: int, s: FlashShape, e: EntryBytes) -> dict[str, float]:
    """Full (all on GPU) sizes of each KV region for one request."""
    n = n_chunks(ctx, s)
    return {
        "c4 kv": s.n_c4 * n * e.kv,
        "index keys": s.n_c4 * n * e.index_key,
        "c128 kv": s.n_c128 * (ctx // s.c128_ratio) * e.kv,
        "swa kv": s.n_layers * min(s.window, ctx) * e.kv,
    }


def _attend_read(ctx: int, s: FlashShape, e: EntryBytes) -> float:
    """KV bytes the attention itself reads per step: top-512 c4 + all c128 + SWA rings (same for every policy)."""
    n = n_chunks(ctx, s)
    swa = s.n_layers * min(s.window, ctx) * e.kv
    return s.n_c4 * min(s.index_topk, n) * e.kv + s.n_c128 * (ctx // s.c128_ratio) * e.kv + swa


def baseline_bytes(ctx: int, s: FlashShape = FlashShape(), e: EntryBytes = EntryBytes()) -> RequestBytes:
    reg = _regions(ctx, s, e)
    read = reg["index keys"] + _attend_read(ctx, s, e)
    return RequestBytes("baseline", sum(reg.values()), 0.0, read, 0.0, 0.0, reg)


def flashmemory_bytes(
    ctx: int,
    kmax: int,
    knobs: PolicyKnobs = PolicyKnobs(),
    s: FlashShape = FlashShape(),
    r: RetrieverShape = RetrieverShape(),
    e: EntryBytes = EntryBytes(),
) -> RequestBytes:
    n = n_chunks(ctx, s)
    res = resident_chunks(kmax, ctx, s, r)
    reg = _regions(ctx, s, e)
    offl_idx_layers = s.n_c4 - r.n_layers if knobs.path_i else 0
    dev = dict(reg)
    dev["c4 kv"] = s.n_c4 * res * e.kv
    dev["index keys"] = (s.n_c4 - offl_idx_layers) * n * e.index_key + offl_idx_layers * res * e.index_key
    host = reg["c4 kv"] + offl_idx_layers * n * e.index_key
    read = (
        s.n_c4 * res * e.index_key  # Level 2: resident keys only
        + r.n_layers * n * e.index_key / r.interval  # Level 1: full history at the retriever layers
        + _attend_read(ctx, s, e)
    )
    cycle = knobs.turnover * res * (s.n_c4 * e.kv + offl_idx_layers * e.index_key)
    # New chunks written back to the host mirror: 1/ratio chunk per step per layer.
    backup = (s.n_c4 * e.kv + offl_idx_layers * e.index_key) / s.c4_ratio
    return RequestBytes("flashmemory", sum(dev.values()), host, read, cycle / r.interval + backup, cycle, dev)


def all_miss_bytes(ctx: int, s: FlashShape = FlashShape(), e: EntryBytes = EntryBytes()) -> float:
    """Worst-case synchronous swap-in per step: every top-512 entry of every c4 layer misses."""
    return min(s.index_topk, n_chunks(ctx, s)) * s.n_c4 * e.kv
