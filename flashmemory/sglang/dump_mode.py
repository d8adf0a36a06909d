"""Dump mode: record golden-label training data per request, in the `flashmemory.dump.format` layout.

A request opts in with sampling params `custom_params={"flashmemory_dump": {...}}`:
  output_dir (absolute path, required), doc_index (int, default: next free in output_dir), topp (0.6),
  min_layers (3), target_csa_layers ([6,8,...] list or "10,12,20"; c4-layer ids in [0, 21)).
Per decode step the recorder takes, for every c4 layer, the native indexer logits of each dumping row and
keeps only that layer's nucleus (`flashmemory.labels.golden.layer_nucleus`); at target layers it also keeps
the indexer-input hidden, the position, the first 3 steps' logits, and the new index-K chunks. A request is
finalized when a decode step runs without it (or the scheduler goes idle); its votes become the CSR labels
and `DumpWriter.commit` writes the document atomically.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from flashmemory.dump.format import N_LOGIT_TOKENS, DumpDoc
from flashmemory.dump.writer import DumpWriter
from flashmemory.env import EnvError, parse_layers
from flashmemory.labels.csr import LabelsCSR
from flashmemory.labels.golden import layer_nucleus

logger = logging.getLogger(__name__)
CUSTOM_KEY = "flashmemory_dump"
_KEYS = {"output_dir", "doc_index", "topp", "min_layers", "target_csa_layers"}


class DumpRequestError(ValueError):
    """A request's `flashmemory_dump` custom param is malformed."""


@dataclass(frozen=True)
class DumpRequest:
    output_dir: str
    doc_index: int | None = None
    topp: float = 0.6
    min_layers: int = 3
    target_csa_layers: tuple[int, ...] = (6, 8, 10, 12, 14, 16, 18, 20)

    @classmethod
    def from_custom_params(cls, custom: object, rid: str = "?", n_c4_layers: int = 21) -> "DumpRequest | None":
        """None when the request does not dump; DumpRequestError naming the rid and key when malformed."""
        if not isinstance(custom, dict) or CUSTOM_KEY not in custom:
            return None
        d = custom[CUSTOM_KEY]
        where = f"request {rid}: custom_params[{CUSTOM_KEY!r}]"
        if not isinstance(d, dict):
            raise DumpRequestError(f"{where} must be an object, got {type(d).__name__}")
        unknown = set(d) - _KEYS
        if unknown:
            raise DumpRequestError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
        out = d.get("output_dir")
        if not isinstance(out, str) or not os.path.isabs(out):
            raise DumpRequestError(f"{where}.output_dir={out!r}: must be an absolute path (the server writes it)")
        try:
            topp = float(d.get("topp", 0.6))
            min_layers = int(d.get("min_layers", 3))
            doc_index = None if d.get("doc_index") is None else int(d["doc_index"])
        except (TypeError, ValueError) as e:
            raise DumpRequestError(f"{where}: topp/min_layers/doc_index must be numbers ({e})") from None
        if not 0.0 < topp <= 1.0 or min_layers < 1 or (doc_index is not None and doc_index < 0):
            raise DumpRequestError(f"{where}: need 0 < topp <= 1, min_layers >= 1, doc_index >= 0; got "
                                   f"topp={topp}, min_layers={min_layers}, doc_index={doc_index}")
        raw = d.get("target_csa_layers", cls.target_csa_layers)
        raw = ",".join(str(x) for x in raw) if isinstance(raw, (list, tuple)) else str(raw)
        try:
            layers = parse_layers(raw, f"{where}.target_csa_layers", n_c4_layers)
        except EnvError as e:
            raise DumpRequestError(str(e)) from None
        return cls(out, doc_index, topp, min_layers, layers)


@dataclass
class _DocState:
    req: DumpRequest
    rid: str
    steps: int = 0
    prompt_pos: int | None = None
    votes: list[dict[int, torch.Tensor]] = field(default_factory=list)    # step -> layer -> kept chunk ids
    hidden: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    positions: dict[int, list[int]] = field(default_factory=dict)
    compk: dict[int, list[torch.Tensor]] = field(default_factory=dict)    # layer -> chunk-row blocks
    n_compk: dict[int, int] = field(default_factory=dict)
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


class DumpRecorder:
    """Per-request dump state. All inputs are plain tensors (any device); state is kept on the CPU."""

    def __init__(self, index_topk: int = 512, ratio: int = 4):
        self.index_topk = index_topk
        self.ratio = ratio
        self.pending: dict[str, DumpRequest] = {}
        self.docs: dict[str, _DocState] = {}
        self.writers: dict[str, DumpWriter] = {}
        self.written: list[dict] = []

    def admit(self, rid: str, custom_params: object) -> bool:
        req = DumpRequest.from_custom_params(custom_params, rid)
        if req is None:
            return False
        self.pending[rid] = req
        return True

    def begin_step(self, rids: list[str]) -> None:
        """Start a decode step over `rids`: finalize documents whose request is gone, open new ones."""
        live = set(rids)
        for rid in [r for r in self.docs if r not in live]:
            self.finalize(rid)
        for rid in rids:
            if rid in self.pending and rid not in self.docs:
                self.docs[rid] = _DocState(self.pending.pop(rid), rid)
        for st in self.docs.values():
            st.votes.append({})
            st.steps += 1

    def observe_layer(self, layer: int, rids: list[str], logits: torch.Tensor, seq_lens: torch.Tensor,
                      positions: torch.Tensor, hidden: torch.Tensor | None = None,
                      new_chunks: "callable | None" = None) -> None:
        """One c4 layer of the current step. logits: [B, N] native (finite for j < seq_lens[b]); hidden: [B, hidden].

        new_chunks(b, start, stop) -> [stop-start, D+4] uint8 chunk rows of row b (only called at target layers).
        """
        for b, rid in enumerate(rids):
            st = self.docs.get(rid)
            if st is None:
                continue
            n = int(seq_lens[b])
            row = logits[b:b + 1, :n].float().cpu()
            idx, keep = layer_nucleus(row, self.index_topk, st.req.topp)
            st.votes[-1][layer] = idx[keep].to(torch.int32)
            pos = int(positions[b])
            if st.prompt_pos is None:
                st.prompt_pos = pos
            if layer not in st.req.target_csa_layers:
                continue
            t = st.steps - 1
            st.positions.setdefault(layer, []).append(pos)
            if hidden is not None:
                st.hidden.setdefault(layer, []).append(hidden[b].detach().to(torch.bfloat16).cpu())
            if t < N_LOGIT_TOKENS:
                st.logits[(layer, t)] = row[0].clone()
            have = st.n_compk.get(layer, 0)
            if new_chunks is not None and n > have:
                st.compk.setdefault(layer, []).append(new_chunks(b, have, n).cpu())
                st.n_compk[layer] = n

    def labels(self, st: _DocState) -> LabelsCSR:
        rows, cols, votes = [], [], []
        for t, per_layer in enumerate(st.votes):
            if not per_layer:
                continue
            ids, cnt = torch.unique(torch.cat(list(per_layer.values())).long(), return_counts=True)
            keep = cnt >= st.req.min_layers
            order = torch.argsort(-cnt[keep] * (ids.max() + 2 if ids.numel() else 1) + ids[keep], stable=True)
            rows.append(torch.full((int(keep.sum()),), t, dtype=torch.long))
            cols.append(ids[keep][order])
            votes.append(cnt[keep][order])
        if not rows:
            return LabelsCSR.empty(len(st.votes))
        return LabelsCSR.from_entries(torch.cat(rows), torch.cat(cols), torch.cat(votes), len(st.votes))

    def finalize(self, rid: str) -> dict | None:
        """Write rid's document (if it saw a decode step at a target layer); returns the metadata line."""
        st = self.docs.pop(rid, None)
        if st is None or not st.positions:
            return None
        layers = sorted(st.positions)
        labels = self.labels(st)
        doc = DumpDoc(
            doc_index=-1, rid=rid,
            hidden={L: torch.stack(st.hidden[L]).float() if st.hidden.get(L) else torch.zeros(len(st.positions[L]), 1)
                    for L in layers},
            positions={L: torch.tensor(st.positions[L], dtype=torch.int64) for L in layers},
            compk={L: torch.cat(st.compk[L]) if st.compk.get(L) else torch.zeros(0, 132, dtype=torch.uint8)
                   for L in layers},
            label_indices=labels.indices, label_scores=labels.scores, label_pointers=labels.pointers,
            n_prompt_blocks=(st.prompt_pos or 0) // self.ratio, ratio=self.ratio,
            native_logits=dict(st.logits), topp=st.req.topp, min_layers=st.req.min_layers)
        w = self.writers.get(st.req.output_dir) or self.writers.setdefault(st.req.output_dir, DumpWriter(st.req.output_dir))
        doc.doc_index = st.req.doc_index if st.req.doc_index is not None else w.next_doc_index
        rec = w.commit(doc)
        self.written.append(rec)
        logger.info("FlashMemory dump: wrote %s (%d decode steps, %d labels)", rec["filename"], doc.n_tokens,
                    rec["n_total_labels"])
        return rec

    def flush_all(self) -> list[dict]:
        return [r for rid in list(self.docs) if (r := self.finalize(rid)) is not None]
