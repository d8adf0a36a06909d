"""Policy evaluation on golden-label dumps: FlashMemory vs recency, random, reactive and oracle."""

from flashmemory.eval.evaluate import EvalConfig, evaluate, format_table
from flashmemory.eval.policies import (
    flashmemory_mask,
    make_flashmemory,
    oracle,
    random_policy,
    reactive,
    recency,
    top_budget,
)

__all__ = [
    "EvalConfig",
    "evaluate",
    "format_table",
    "flashmemory_mask",
    "make_flashmemory",
    "oracle",
    "random_policy",
    "reactive",
    "recency",
    "top_budget",
]
