"""Dump mode: the server side of `flashmemory.dump.protocol` (record golden-label data per request).

A request opts in with `custom_params={"flashmemory_dump": {...}}` as `flashmemory.dump.protocol.DumpRequest`
writes it (version, pass 1|2, doc_index, absolute output_dir, topp, min_layers, target_csa_layers,
n_logit_tokens, store_topk, topk_interval); the same parser reads it here, and output_dir must lie under the
operator's root (SGLANG_FLASHMEMORY_DUMP_ROOT, `DumpRecorder(root=...)`): a request outside it is refused. Per
decode step the recorder takes, for every c4 layer, the native indexer logits of each dumping row and keeps only
that layer's nucleus
(`flashmemory.labels.golden.layer_nucleus`) and, for pass-1 requests at the steps `store_topk` picks
(`flashmemory.dump.format.topk_store_steps`), the layer's top-`index_topk` ids + logits (`native_topk_rows`,
-1 / -inf padded; never the full logits); at target layers it also keeps the indexer-input hidden, the
position, the first n_logit_tokens steps' logits, and the new index-K chunks. A request is finalized when a
decode step runs without it (or the scheduler goes idle): its votes become the CSR labels and the document
is written atomically with `save_doc_file` to `DumpRequest.doc_path()` (`<output_dir>/pass{1,2}/doc_{idx:05d}
.safetensors`). The client (`flashmemory.dump.sglang_backend`) merges pass 2's compk into pass 1 and
commits; the server never touches `server_metadata.jsonl`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from flashmemory.dump.confine import ConfineError, DocTargets
from flashmemory.dump.format import DumpDoc, DumpFormatError, native_topk_rows
from flashmemory.dump.protocol import DumpProtocolError, DumpRequest, under_root
from flashmemory.dump.writer import save_doc_file
from flashmemory.errors import describe
from flashmemory.labels.csr import LabelsCSR
from flashmemory.labels.golden import layer_nucleus

logger = logging.getLogger(__name__)
DumpRequestError = DumpProtocolError  # one parser, one error type: flashmemory.dump.protocol


def write_failure(e: BaseException) -> str:
    """One line for a document that could not be written: the path and the OS's reason for a file-system error
    (a name too long, a file where a folder should be, a folder replaced or not empty), the message of a refused
    directory or an invalid document, the type as well only for anything else (a bug)."""
    if isinstance(e, ConfineError):
        return " ".join(str(e).split())
    if isinstance(e, OSError):
        return describe(e)
    if isinstance(e, (DumpFormatError, DumpProtocolError)):
        return " ".join(str(e).split())
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def parse_request(
    custom_params: object, rid: str = "?", n_c4_layers: int = 21, root: str | os.PathLike | None = None
) -> DumpRequest | None:
    """The request's dump block via the shared protocol parser; None for a normal request. Errors name the rid.

    root: the operator's dump root (SGLANG_FLASHMEMORY_DUMP_ROOT); output_dir must lie inside it (None:
    no root, every dump request is refused). min_layers and the layer ids must fit n_c4_layers."""
    try:
        req = DumpRequest.from_custom_params(custom_params)
        if req is not None:
            under_root(req.output_dir, root)
    except DumpProtocolError as e:
        raise DumpProtocolError(f"request {rid}: {e}") from None
    if req is not None:
        bad = [x for x in req.target_csa_layers if not 0 <= x < n_c4_layers]
        if bad:
            raise DumpProtocolError(
                f"request {rid}: target_csa_layers {list(req.target_csa_layers)}: {bad} outside "
                f"[0, {n_c4_layers}) (ids count c4 layers)"
            )
        if req.min_layers > n_c4_layers:
            raise DumpProtocolError(
                f"request {rid}: flashmemory_dump.min_layers={req.min_layers}: the model has "
                f"{n_c4_layers} c4 layers, so no chunk could get that many votes"
            )
    return req


@dataclass
class _DocState:
    req: DumpRequest
    rid: str
    steps: int = 0
    prompt_pos: int | None = None
    votes: list[dict[int, torch.Tensor]] = field(default_factory=list)  # step -> layer -> kept chunk ids
    hidden: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    positions: dict[int, list[int]] = field(default_factory=dict)
    compk: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> chunk-row blocks
    n_compk: dict[int, int] = field(default_factory=dict)
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    topk: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)  # t -> C -> ids, vals

    def stores_topk(self, t: int) -> bool:
        """Whether decode step t keeps the native top-k (pass 1 only; the rule of `topk_store_steps`)."""
        mode = self.req.store_topk
        return self.req.pass_ == 1 and (mode == "all" or (mode == "cycle" and t % self.req.topk_interval == 0))

    def topk_store(self) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The DumpDoc fields native_topk (C -> [S, k] int32 / float32) and native_topk_steps ([S] int32)."""
        layers = sorted({C for per in self.topk.values() for C in per})
        steps = [t for t in sorted(self.topk) if t < len(self.votes) and all(C in self.topk[t] for C in layers)]
        if len(steps) != len(self.topk):
            logger.warning(
                "FlashMemory dump: request %s: native top-k of step(s) %s miss some of layers %s; dropped",
                self.rid,
                sorted(set(self.topk) - set(steps))[:8],
                layers,
            )
        if not steps or not layers:
            return {}, torch.zeros(0, dtype=torch.int32)
        store = {
            C: (torch.stack([self.topk[t][C][0] for t in steps]), torch.stack([self.topk[t][C][1] for t in steps]))
            for C in layers
        }
        return store, torch.tensor(steps, dtype=torch.int32)


class DumpRecorder:
    """Per-request dump state. All inputs are plain tensors (any device); state is kept on the CPU."""

    def __init__(
        self, index_topk: int = 512, ratio: int = 4, n_c4_layers: int = 21, root: str | os.PathLike | None = None
    ):
        self.root = root  # the only tree dump files are written under (None: dump requests are refused)
        self.targets = DocTargets(root)  # admission checks each target; writes go through a held root fd, no symlinks
        self.index_topk = index_topk
        self.ratio = ratio
        self.n_c4_layers = n_c4_layers
        self.pending: dict[str, DumpRequest] = {}
        self.docs: dict[str, _DocState] = {}
        self.written: list[str] = []  # paths of the per-pass files written
        self.failed: list[str] = []  # rids whose document could not be written (logged)

    def admit(self, rid: str, custom_params: object) -> bool:
        req = parse_request(custom_params, rid, self.n_c4_layers, self.root)
        if req is None:
            return False
        self.targets.admit(rid, req)  # a document that cannot be written there is refused now, with the reason
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

    def observe_layer(
        self,
        layer: int,
        rids: list[str],
        logits: torch.Tensor,
        seq_lens: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None = None,
        new_chunks: "callable | None" = None,
    ) -> None:
        """One c4 layer of the current step. logits: [B, N] native (finite for j < seq_lens[b]); hidden: [B, hidden].

        new_chunks(b, start, stop) -> [stop-start, D+4] uint8 chunk rows of row b (only called at target layers).
        """
        for b, rid in enumerate(rids):
            st = self.docs.get(rid)
            if st is None:
                continue
            n = int(seq_lens[b])
            row = logits[b : b + 1, :n].float().cpu()
            idx, keep = layer_nucleus(row, self.index_topk, st.req.topp)
            st.votes[-1][layer] = idx[keep].to(torch.int32)
            t = st.steps - 1
            if st.stores_topk(t):
                ti, tv = native_topk_rows(row, torch.tensor([n]), self.index_topk)
                st.topk.setdefault(t, {})[layer] = (ti[0], tv[0])
            pos = int(positions[b])
            if st.prompt_pos is None:
                st.prompt_pos = pos
            if layer not in st.req.target_csa_layers:
                continue
            st.positions.setdefault(layer, []).append(pos)
            if hidden is not None:
                st.hidden.setdefault(layer, []).append(hidden[b].detach().to(torch.bfloat16).cpu())
            if t < st.req.n_logit_tokens:
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

    def finalize(self, rid: str) -> str | None:
        """Write rid's per-pass file (if it saw a decode step at a target layer) to `DumpRequest.doc_path()`
        with `save_doc_file` (atomic); the client merges the passes and commits. Returns the path.

        Runs inside the scheduler: a document that fails (validation, disk) is logged and counted in
        `self.failed`, never raised; the client then finds no file and fails that item with a clear message."""
        st = self.docs.pop(rid, None)
        if st is None or not st.positions:
            self.targets.forget(rid)
            return None
        try:
            return self._write(st)
        except Exception as e:  # noqa: BLE001  (the serving process must outlive one bad document)
            self.failed.append(rid)
            logger.error(
                "FlashMemory dump: request %s: document not written to %s: %s", rid, st.req.doc_path(), write_failure(e)
            )
            return None

    def _write(self, st: _DocState) -> str:
        rid = st.rid
        layers = sorted(st.positions)
        labels = self.labels(st)
        topk, topk_steps = st.topk_store()
        doc = DumpDoc(
            doc_index=st.req.doc_index,
            rid=rid,
            hidden={
                L: torch.stack(st.hidden[L]).float() if st.hidden.get(L) else torch.zeros(len(st.positions[L]), 1)
                for L in layers
            },
            positions={L: torch.tensor(st.positions[L], dtype=torch.int64) for L in layers},
            compk={
                L: torch.cat(st.compk[L]) if st.compk.get(L) else torch.zeros(0, 132, dtype=torch.uint8) for L in layers
            },
            label_indices=labels.indices,
            label_scores=labels.scores,
            label_pointers=labels.pointers,
            n_prompt_blocks=(st.prompt_pos or 0) // self.ratio,
            ratio=self.ratio,
            native_logits=dict(st.logits),
            topp=st.req.topp,
            min_layers=st.req.min_layers,
            native_topk=topk,
            native_topk_steps=topk_steps,
        )
        path = st.req.doc_path()
        with self.targets.open_dir(rid, st.req) as dir_fd:  # walked again from the root: a swapped dir is refused
            save_doc_file(path, doc, dir_fd=dir_fd)
        self.written.append(str(path))
        logger.info(
            "FlashMemory dump: wrote %s (pass %d, %d decode steps, %d labels, native top-k at %d steps)",
            path,
            st.req.pass_,
            doc.n_tokens,
            int(doc.label_indices.numel()),
            int(topk_steps.numel()),
        )
        return str(path)

    def flush_all(self) -> list[str]:
        return [r for rid in list(self.docs) if (r := self.finalize(rid)) is not None]
