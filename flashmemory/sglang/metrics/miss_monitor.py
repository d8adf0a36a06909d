"""The miss monitor behind sglang (`SGLANG_RETRIEVER_MISS_MONITOR=1`), for copy and shrink mode alike.

The native query of a target c4 layer is recomputed off the decode path from what the side band carried out of
the forward: the indexer's input x (`hidden_{l}`) and its q_lora (`q_lora_{l}`), through sglang's own
`C4Indexer.compute_weights` / `compute_q` (the module the indexer hook saw, `RUNTIME.indexers`), exactly as the
dump mode recomputes native logits. It is scored against the engine's target index-K (on the device in both
modes, `OffloadEngine.target_keys`). Until a target layer's indexer has been seen (first decode forward) the
monitor skips its measurement; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from flashmemory.offload import OffloadEngine
from flashmemory.residency.escalation import EscalationConfig, EscalationController
from flashmemory.residency.monitor import keys_native_scorer
from flashmemory.residency.monitored import MissMonitor


def indexer_query(
    indexers: Mapping[int, Any], layer: int, hidden: Mapping[Any, torch.Tensor], position: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q fp32 [H, D], w fp32 [H]) of one request at c4 layer `layer`, or None when the inputs are not there.
    hidden: Level 1's per-request inputs ({layer: x [hidden], ("q_lora", layer): q_lora [rank]})."""
    ind, x, ql = indexers.get(layer), hidden.get(layer), hidden.get(("q_lora", layer))
    if ind is None or x is None or ql is None:
        return None
    with torch.no_grad():
        weights = ind.compute_weights(x.reshape(1, -1), skip_scale=True)
        q, w = ind.compute_q(ql.reshape(1, -1), position.reshape(1).to(ql.device), weights)
    q = q[0] if isinstance(q, tuple) else q
    return q.reshape(-1, q.shape[-1]).float(), w.reshape(-1).float()


def build_monitor(
    cfg: EscalationConfig | None, eng: OffloadEngine, indexers: Callable[[], Mapping[int, Any]]
) -> MissMonitor | None:
    """The adapter's MissMonitor (None with the gate off, cfg None; `core_config.escalation_config` makes cfg).
    indexers: returns the current map target c4 layer -> sglang's C4Indexer (the runtime shares its own map,
    filled by the indexer hook as layers run), read at each measurement."""
    if cfg is None:
        return None
    if cfg.cap > eng.cfg.max_resident_pages:
        raise ValueError(
            f"miss monitor cap {cfg.cap} pages exceeds the engine's per-request cap {eng.cfg.max_resident_pages}"
        )
    ctl = EscalationController(cfg, free_blocks=eng.free_blocks)
    native = keys_native_scorer(eng, lambda row, layer, hidden, pos: indexer_query(indexers(), layer, hidden, pos))
    return MissMonitor(eng, native, ctl, eng.layout.target_layers)


def monitor_stats(snap_total: Mapping[str, Any], recent: list[float]) -> dict[str, Any]:
    """The monitor's keys of `flashmemory.sglang.metrics.prometheus.METRICS` from the core's running totals
    (`engine.totals()`) and its most recent miss-mass values (oldest first)."""
    return {
        k: float(snap_total.get(k, 0))
        for k in ("monitor_cycles", "escalations", "escalations_denied", "fallbacks", "missing_pages_added")
    } | {
        "budget_pages_mean": float(snap_total.get("budget_pages_mean", 0.0)),
        "requests_in_fallback": float(snap_total.get("in_fallback", 0)),
        "miss_mass": (int(snap_total.get("miss_n", 0)), list(recent)),
    }
