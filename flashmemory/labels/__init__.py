"""Golden labels: per-token nucleus votes over the native indexer logits, stored as CSR."""

from flashmemory.labels.csr import LabelsCSR, LabelsError
from flashmemory.labels.golden import golden_labels, layer_nucleus, vote_labels
from flashmemory.labels.lookahead import lookahead_union, lookahead_union_all

__all__ = [
    "LabelsCSR",
    "LabelsError",
    "golden_labels",
    "layer_nucleus",
    "vote_labels",
    "lookahead_union",
    "lookahead_union_all",
]
