"""Small synthetic dump documents for format / writer / client tests (no model needed)."""

import torch

from flashmemory.dump import DumpDoc
from flashmemory.labels import golden_labels
from flashmemory.retriever.fp8 import quantize_chunks


def make_doc(doc_index=0, P=37, T=9, layers=(1, 3), hidden=8, D=16, seed=0, ratio=4):
    g = torch.Generator().manual_seed(seed + 1000 * doc_index)
    pos = torch.arange(P, P + T, dtype=torch.int64)
    N = (P + T) // ratio
    vis = (pos + 1) // ratio
    lg = torch.randn(4, T, N, generator=g).masked_fill(torch.arange(N)[None, None] >= vis[None, :, None], float("-inf"))
    lab = golden_labels(lg, topk=8, topp=0.6, min_layers=2)
    return DumpDoc(
        doc_index=doc_index,
        rid=f"r{doc_index}",
        hidden={L: torch.randn(T, hidden, generator=g) for L in layers},
        positions={L: pos.clone() for L in layers},
        compk={L: quantize_chunks(torch.randn(N, D, generator=g)) for L in layers},  # finite keys and scales
        label_indices=lab.indices,
        label_scores=lab.scores,
        label_pointers=lab.pointers,
        n_prompt_blocks=P // ratio,
        ratio=ratio,
        native_logits={(L, t): lg[0, t, : int(vis[t])].clone() for L in layers for t in range(min(3, T))},
        topp=0.6,
        min_layers=2,
        input_ids=torch.arange(P + T),
    )
