"""Residency: the Level-1 selection policy and cycle (what stays on the device), the Level-2 top-k, and the miss
monitor with per-request escalation (what notices and repairs a wrong Level-1 prediction)."""

from flashmemory.residency.policy import (
    PagePolicy,
    SelectionConfig,
    ThresholdPagePolicy,
    ensemble_scores,
    forced_mask,
    page_keys,
    select_chunks,
    select_pages,
)

__all__ = [
    "PagePolicy",
    "SelectionConfig",
    "ThresholdPagePolicy",
    "ensemble_scores",
    "forced_mask",
    "page_keys",
    "select_chunks",
    "select_pages",
    "Level1",
    "Level1Config",
    "Level2",
    "Level2Out",
    "paged_index_logits",
    "retriever_scorer",
    "miss_mass",
    "miss_report",
    "EscalationConfig",
    "EscalationController",
    "MissMonitor",
]


def __getattr__(name: str):
    # Lazy: level1/level2 import the offload engine, which policy users do not need.
    if name in ("Level1", "Level1Config", "retriever_scorer"):
        from flashmemory.residency import level1

        return getattr(level1, name)
    if name in ("Level2", "Level2Out", "paged_index_logits"):
        from flashmemory.residency import level2

        return getattr(level2, name)
    if name in ("miss_mass", "miss_report"):
        from flashmemory.residency import monitor

        return getattr(monitor, name)
    if name in ("EscalationConfig", "EscalationController"):
        from flashmemory.residency import escalation

        return getattr(escalation, name)
    if name == "MissMonitor":
        from flashmemory.residency.monitored import MissMonitor

        return MissMonitor
    raise AttributeError(f"module 'flashmemory.residency' has no attribute {name!r}")
