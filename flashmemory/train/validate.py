"""Full-set validation: score ALL scoreable chunks of each val doc every `stride` decode steps.

Per layer and for the max ("or", what serving uses by default) and mean ensembles of per-layer
sigmoids: precision / recall / F1 at the threshold, recall@K, ROC-AUC and the resident fraction
(see `flashmemory.train.metrics`). Targets are the lookahead window unions of `SampleConfig`, so
causal mode scores only the chunks that exist at t, like serving.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashmemory.retriever.fp8 import dequantize_chunks
from flashmemory.retriever.model import JointRetriever
from flashmemory.train.dataset import DocCache, check_layers, check_sizes
from flashmemory.train.metrics import K_LIST, RowMetrics, auto_k_scale, effective_k
from flashmemory.train.samples import SampleConfig, doc_targets

ENSEMBLES = ("max", "mean")


@torch.no_grad()
def score_rows(
    model: JointRetriever,
    doc,
    rows: torch.Tensor,
    n_avail: torch.Tensor,
    device: torch.device | str,
    chunk_rows: int = 256,
) -> dict[int, torch.Tensor]:
    """Sigmoid scores {L: [R, n_max]} of decode steps `rows` against chunks [0, n_max); columns
    >= n_avail[row] are 0. n_max = max(n_avail)."""
    n_max = int(n_avail.max()) if rows.numel() else 0
    out: dict[int, torch.Tensor] = {}
    for L in model.layers:
        layer = model.layer(L)
        keys = dequantize_chunks(doc.compk[L][:n_max]).to(device)
        parts = []
        for s in range(0, rows.numel(), chunk_rows):
            r = rows[s : s + chunk_rows]
            h = doc.hidden[L][r].to(device)
            pos = doc.positions[L][r].to(device)
            parts.append(layer(h, pos, keys, n_avail[s : s + chunk_rows].to(device)).float().cpu())
        out[L] = torch.cat(parts) if parts else torch.zeros(0, n_max)
    return out


class Validator:
    """Holds the val docs' targets; calling it scores a model and returns a metrics dict."""

    def __init__(
        self,
        paths: list[Path],
        layers: tuple[int, ...],
        cfg: SampleConfig,
        stride: int = 4,
        threshold: float = 0.5,
        k_scale: float | None = None,
        allow_pickle: bool = False,
        cache_size: int = 64,
        sizes: tuple[int, int] | None = None,
    ):
        """sizes: (hidden size, index-key dim) every val doc must have (the train split's), if given."""
        if stride < 1:
            raise ValueError(f"val stride must be >= 1, got {stride}")
        self.cache = DocCache(paths, cache_size, allow_pickle)
        self.layers = tuple(layers)
        self.threshold = threshold
        self.rows: list[tuple[torch.Tensor, torch.Tensor, object]] = []  # (rows, n_avail, union CSR)
        n_max = 1
        for i, p in enumerate(self.cache.paths):
            doc = self.cache.get(i)
            check_layers(doc, self.layers, str(p))
            if sizes is not None:
                check_sizes(doc, self.layers, f"val split: {p}", sizes, "the train split")
            tg = doc_targets(doc, cfg)
            rows = torch.arange(0, doc.n_tokens, stride)
            rows = rows[tg.n_avail[rows] > 0]
            self.rows.append((rows, tg.n_avail[rows], tg.union))
            if rows.numel():
                n_max = max(n_max, int(tg.n_avail[rows].max()))
        self.k_scale = auto_k_scale(n_max) if k_scale is None else k_scale
        self.k_eff = {k: effective_k(k, self.k_scale) for k in K_LIST}

    def __call__(self, model: JointRetriever, device: torch.device | str = "cpu") -> dict:
        was_training = model.training
        model.eval()
        acc = {str(L): RowMetrics(self.threshold, K_LIST, self.k_scale) for L in self.layers}
        acc.update({e: RowMetrics(self.threshold, K_LIST, self.k_scale) for e in ENSEMBLES})
        for i, (rows, n_avail, union) in enumerate(self.rows):
            if rows.numel() == 0:
                continue
            scores = score_rows(model, self.cache.get(i), rows, n_avail, device)
            stacked = torch.stack([scores[L] for L in self.layers])
            ens = {"max": stacked.amax(0), "mean": stacked.mean(0)}
            for j, t in enumerate(rows.tolist()):
                n = int(n_avail[j])
                labels = torch.zeros(n, dtype=torch.bool)
                idx, _ = union.row(t)
                labels[idx.long()] = True
                for L in self.layers:
                    acc[str(L)].add(scores[L][j, :n], labels)
                for e in ENSEMBLES:
                    acc[e].add(ens[e][j, :n], labels)
        if was_training:
            model.train()
        res = {name: a.result() for name, a in acc.items()}
        return {
            "layers": {L: res[str(L)] for L in self.layers},
            **{e: res[e] for e in ENSEMBLES},
            "k_scale": self.k_scale,
            "k_eff": self.k_eff,
            "threshold": self.threshold,
        }
