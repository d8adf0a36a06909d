"""Analytic cost model of DeepSeek-V4-Flash decode with and without FlashMemory (FLOPs, bytes, an estimate
of throughput), with a disk-tier arm (`disk`), sglang's pool sizing (`pools`) and the calibration against the
published figures (`anchors`). Pure functions; `flashmemory bench costmodel` prints it next to upstream's tables."""

from flashmemory.costmodel.bytes import (
    EntryBytes,
    PolicyKnobs,
    RequestBytes,
    all_miss_bytes,
    baseline_bytes,
    flashmemory_bytes,
)
from flashmemory.costmodel.disk import DiskKnobs, DiskPoint, disk_point, max_conc_within
from flashmemory.costmodel.flops import (
    CountRules,
    FlashShape,
    FlopBreakdown,
    RetrieverShape,
    Term,
    attention_core_terms,
    baseline_flops,
    constant_terms,
    fit_line,
    flashmemory_flops,
    n_chunks,
    resident_chunks,
)
from flashmemory.costmodel.hisparse import HiSparseKnobs, hisparse_bytes, hisparse_swap_tokens, swap_kernel_ms
from flashmemory.costmodel.throughput import (
    Estimate,
    Hardware,
    estimate,
    kv_budget_per_gpu,
    throughput_at,
    weight_bytes,
)

# Upstream README (8xH20, TP8): context -> (KMAX, baseline GFLOP, ours GFLOP, baseline conc, baseline tok/s,
# ours conc, ours tok/s). Reference values to compare against, never used inside the model.
UPSTREAM = {
    262144: (96, 50.8, 28.8, 47, 1584, 76, 2759),
    524288: (192, 73.5, 31.0, 25, 1028, 60, 2008),
    1048576: (384, 118.9, 35.4, 11, 455, 30, 1266),
}
UPSTREAM_CONSTANT_GFLOP = 26.6

__all__ = [
    "UPSTREAM",
    "UPSTREAM_CONSTANT_GFLOP",
    "CountRules",
    "FlashShape",
    "FlopBreakdown",
    "RetrieverShape",
    "Term",
    "attention_core_terms",
    "baseline_flops",
    "constant_terms",
    "fit_line",
    "flashmemory_flops",
    "n_chunks",
    "resident_chunks",
    "EntryBytes",
    "PolicyKnobs",
    "RequestBytes",
    "all_miss_bytes",
    "baseline_bytes",
    "flashmemory_bytes",
    "hisparse_bytes",
    "HiSparseKnobs",
    "hisparse_swap_tokens",
    "Estimate",
    "Hardware",
    "estimate",
    "kv_budget_per_gpu",
    "throughput_at",
    "weight_bytes",
    "DiskKnobs",
    "DiskPoint",
    "disk_point",
    "max_conc_within",
    "swap_kernel_ms",
]
