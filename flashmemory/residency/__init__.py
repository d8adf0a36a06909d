"""Residency: the Level-1 selection policy (what stays on the device) and the Level-2 mask."""

from flashmemory.residency.policy import (PagePolicy, SelectionConfig, ThresholdPagePolicy, ensemble_scores,
                                          forced_mask, page_keys, select_chunks, select_pages)

__all__ = ["PagePolicy", "SelectionConfig", "ThresholdPagePolicy", "ensemble_scores", "forced_mask", "page_keys",
           "select_chunks", "select_pages"]
