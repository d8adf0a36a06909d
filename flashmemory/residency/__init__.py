"""Residency: the Level-1 selection policy and cycle (what stays on the device) and the Level-2 top-k."""

from flashmemory.residency.policy import (PagePolicy, SelectionConfig, ThresholdPagePolicy, ensemble_scores,
                                          forced_mask, page_keys, select_chunks, select_pages)

__all__ = ["PagePolicy", "SelectionConfig", "ThresholdPagePolicy", "ensemble_scores", "forced_mask", "page_keys",
           "select_chunks", "select_pages", "Level1", "Level1Config", "Level2", "Level2Out", "paged_index_logits",
           "retriever_scorer"]


def __getattr__(name: str):
    # Lazy: level1/level2 import the offload engine, which policy users do not need.
    if name in ("Level1", "Level1Config", "retriever_scorer"):
        from flashmemory.residency import level1
        return getattr(level1, name)
    if name in ("Level2", "Level2Out", "paged_index_logits"):
        from flashmemory.residency import level2
        return getattr(level2, name)
    raise AttributeError(f"module 'flashmemory.residency' has no attribute {name!r}")
