"""Dump documents as a torch Dataset of (doc, t) training samples, and its collate function.

Only the small per-doc label state (`DocTargets`) stays in memory for every doc; hidden states and
keys are reloaded through a small LRU when a sample needs them. Sampling is deterministic in
(seed, epoch, sample index), so a resumed run draws the same negatives as an uninterrupted one.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch
from torch.utils.data import Dataset

from flashmemory.dump.format import DumpDoc, list_docs, load_doc
from flashmemory.retriever.fp8 import dequantize_chunks
from flashmemory.train.data_config import DataConfigError, DataSpec
from flashmemory.train.samples import DocTargets, SampleConfig, doc_targets, draw_sample

_DOC_ID = re.compile(r"doc_(\d+)\.")


def resolve_docs(specs: tuple[DataSpec, ...] | list[DataSpec], what: str = "data") -> list[Path]:
    """Doc file paths of every spec (whitelisted by doc_ids).

    A listed doc_id without a complete document is a DataConfigError naming the directory and the ids:
    a split that silently trains or validates on fewer documents than its config names would give
    numbers that cannot be compared or reproduced (drop the ids from the config, or finish the dump).
    An empty result is an error naming the directories, since training on nothing is never meant.
    """
    out: list[Path] = []
    for s in specs:
        docs = list_docs(s.data_dir)
        if s.doc_ids is not None:
            have = {int(m.group(1)): p for p in docs if (m := _DOC_ID.match(p.name))}
            missing = [i for i in s.doc_ids if i not in have]
            if missing:
                more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
                shown = ", ".join(map(str, missing[:10])) + more
                raise DataConfigError(
                    f"{what}: {s.data_dir}: doc_ids {shown} have no complete document (no "
                    "server_metadata.jsonl line or no file); remove them from the data config "
                    "or finish the dump"
                )
            docs = [have[i] for i in sorted(s.doc_ids)]
        out.extend(docs)
    if not out:
        dirs = ", ".join(str(s.data_dir) for s in specs) or "(none)"
        raise DataConfigError(
            f"{what}: no complete dump documents in {dirs} (a doc counts once its line is in "
            "server_metadata.jsonl; check doc_ids)"
        )
    return out


class DocCache:
    """Loads docs by path with a bounded LRU; `allow_pickle` is passed through to `load_doc`."""

    def __init__(self, paths: list[Path], size: int = 64, allow_pickle: bool = False):
        self.paths = list(paths)
        self.size = max(1, size)
        self.allow_pickle = allow_pickle
        self._lru: OrderedDict[int, DumpDoc] = OrderedDict()

    def __len__(self) -> int:
        return len(self.paths)

    def get(self, i: int) -> DumpDoc:
        if i in self._lru:
            self._lru.move_to_end(i)
            return self._lru[i]
        doc = load_doc(self.paths[i], allow_pickle=self.allow_pickle)
        self._lru[i] = doc
        if len(self._lru) > self.size:
            self._lru.popitem(last=False)
        return doc


def check_layers(doc: DumpDoc, layers: tuple[int, ...], source: str) -> None:
    missing = [L for L in layers if L not in doc.hidden]
    if missing:
        raise DataConfigError(
            f"{source}: dump has target layers {doc.target_layers}, not the requested --joint-layers {missing}"
        )


def check_sizes(
    doc: DumpDoc, layers: tuple[int, ...], source: str, want: tuple[int, int] | None, want_source: str = ""
) -> tuple[int, int]:
    """(hidden size, index-key dim) of `doc`'s `layers`, the same for every layer and equal to `want` when given.

    Documents of one run must come from one model: samples of different sizes cannot be batched (a
    DataConfigError naming both files here, not a `torch.stack` error mid-epoch)."""
    for L in layers:
        got = (int(doc.hidden[L].shape[-1]), int(doc.compk[L].shape[-1]) - 4)
        if want is None:
            want, want_source = got, f"{source} layer {L}"
        elif got != want:
            raise DataConfigError(
                f"{source}: layer {L} has hidden size {got[0]} and index-key dim {got[1]}, but "
                f"{want_source} has {want[0]} and {want[1]}: every document of a run must be "
                "dumped from the same model"
            )
    assert want is not None
    return want


class SampleDataset(Dataset):
    """Items: one training sample per (doc, t); see `flashmemory.train.samples`.

    __getitem__ returns {"hidden": {L: [hidden] f32}, "position": int64 [], "keys": {L: [n, D] f32},
    "ids": [n] int64, "target": [n] f32, "weight": [n] f32, "n_avail": int, "doc": int, "t": int}.
    """

    def __init__(
        self,
        paths: list[Path],
        layers: tuple[int, ...],
        cfg: SampleConfig,
        seed: int = 0,
        cache_size: int = 64,
        allow_pickle: bool = False,
    ):
        self.cache = DocCache(paths, cache_size, allow_pickle)
        self.layers = tuple(layers)
        self.cfg = cfg
        self.seed = seed
        self.epoch = 0
        self.targets: list[DocTargets] = []
        index = []
        self.max_position = 0
        self.sizes: tuple[int, int] | None = None  # (hidden size, index-key dim), one for all documents
        first = ""
        for i, p in enumerate(self.cache.paths):
            doc = self.cache.get(i)
            check_layers(doc, self.layers, str(p))
            first = first or f"{p} layer {self.layers[0]}"
            self.sizes = check_sizes(doc, self.layers, str(p), self.sizes, first)
            tg = doc_targets(doc, cfg)
            self.targets.append(tg)
            index.append(torch.stack((torch.full_like(tg.rows, i), tg.rows), 1))
            if doc.n_tokens:
                self.max_position = max(self.max_position, int(doc.positions[self.layers[0]].max()))
        self.index = torch.cat(index) if index else torch.zeros(0, 2, dtype=torch.long)
        if self.sizes is None:
            raise DataConfigError("no documents to train on")
        self.hidden_size, self.head_dim = self.sizes

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __getitem__(self, i: int) -> dict:
        d, t = (int(x) for x in self.index[i])
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch * 7_919 + i) % (2**63))
        ids, target, weight = draw_sample(self.targets[d], t, self.cfg, gen)
        doc = self.cache.get(d)
        return {
            "hidden": {L: doc.hidden[L][t].float() for L in self.layers},
            "position": doc.positions[self.layers[0]][t].long(),
            "keys": {L: dequantize_chunks(doc.compk[L][ids]) for L in self.layers},
            "ids": ids,
            "target": target,
            "weight": weight,
            "n_avail": int(self.targets[d].n_avail[t]),
            "doc": d,
            "t": t,
        }


def collate(items: list[dict]) -> dict:
    """Stack samples, zero-padding the chunk axis to the longest: keys {L: [B, n, D]}, target/weight
    [B, n] f32, ids [B, n] int64 (-1 pad), mask [B, n] bool, hidden {L: [B, hidden]}, positions [B]."""
    b = len(items)
    n = max((it["ids"].numel() for it in items), default=0)
    layers = list(items[0]["hidden"])
    d = items[0]["keys"][layers[0]].shape[-1]
    keys = {L: torch.zeros(b, n, d) for L in layers}
    target, weight = torch.zeros(b, n), torch.zeros(b, n)
    ids = torch.full((b, n), -1, dtype=torch.long)
    mask = torch.zeros(b, n, dtype=torch.bool)
    for r, it in enumerate(items):
        k = it["ids"].numel()
        for L in layers:
            keys[L][r, :k] = it["keys"][L]
        target[r, :k], weight[r, :k], ids[r, :k], mask[r, :k] = it["target"], it["weight"], it["ids"], True
    return {
        "hidden": {L: torch.stack([it["hidden"][L] for it in items]) for L in layers},
        "positions": torch.stack([it["position"] for it in items]),
        "keys": keys,
        "target": target,
        "weight": weight,
        "ids": ids,
        "mask": mask,
        "n_avail": torch.tensor([it["n_avail"] for it in items]),
        "doc": torch.tensor([it["doc"] for it in items]),
        "t": torch.tensor([it["t"] for it in items]),
    }
