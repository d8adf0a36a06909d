"""The golden-label dump: one `doc_{idx:05d}.safetensors` per document plus `server_metadata.jsonl`.

Tensors in a doc file (L = c4-layer id of a target CSA layer, T decode tokens, N chunks):
  hidden_layer_{L}            [T, hidden] bf16   indexer-input hidden of decode step t
  positions_layer_{L}         [T] int64          position of decode step t (= P + t, P = prompt length)
  compk_layer_{L}             [N, D+4] uint8     stored index keys over prompt + response (Hadamard, fp8 chunk)
  label_indices/label_scores  [E] int32          golden chunk ids / layer votes, CSR rows per decode step
  label_pointers              [T+1] int32
  logits_layer_{L}_token_{t}  [n_t] float32      native indexer logits of the first decode steps (verification)
  input_ids                   [P+T] int64        optional: the tokens (prompt then response)
  native_topk_steps           [S] int32          optional: decode steps whose native top-k is stored (ascending)
  native_topk_idx_layer_{C}   [S, k] int32       optional, every c4 layer C (not only targets): native top-k
                                                 chunk ids of those steps, sorted by logit descending; -1 = invalid
  native_topk_val_layer_{C}   [S, k] float32     their native logits; -inf where the id is -1 (k = index_topk)
Decode step t is the query at position P+t whose input is response token t; it sees chunks
j < (P+t+1)//ratio. Scalars live in the safetensors metadata (all strings): format, doc_index, rid,
n_prompt_blocks (= P//ratio, chunks made of prompt tokens only), ratio, topp, min_layers, target_csa_layers.
A document is complete only once its line is in `server_metadata.jsonl` (the writer appends it last).
"""

from __future__ import annotations

import math
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashmemory.dump.errors import DumpFormatError
from flashmemory.dump.metadata import DOC_RE as _DOC_RE
from flashmemory.dump.metadata import METADATA_FILE, list_docs, metadata_lines, read_metadata
from flashmemory.labels.csr import LabelsCSR, LabelsError

__all__ = [
    "FORMAT",
    "METADATA_FILE",
    "DumpDoc",
    "DumpFormatError",
    "doc_filename",
    "list_docs",
    "load_doc",
    "read_metadata",
]

FORMAT = "flashmemory-dump/1"
N_LOGIT_TOKENS = 3
_KEY_RE = re.compile(r"^(hidden|positions|compk)_layer_(\d+)$")
_LOGIT_RE = re.compile(r"^logits_layer_(\d+)_token_(\d+)$")
_TOPK_RE = re.compile(r"^native_topk_(idx|val)_layer_(\d+)$")
TOPK_STEPS_KEY = "native_topk_steps"
STORE_TOPK_MODES = ("none", "cycle", "all")


def doc_filename(doc_index: int, suffix: str = "safetensors") -> str:
    return f"doc_{doc_index:05d}.{suffix}"


@dataclass
class DumpDoc:
    """One dumped document, in memory. hidden is float32 after loading (bf16 on disk).

    native_topk: c4-layer id C (every c4 layer, not only the targets) -> (idx [S, k] int32 chunk ids,
    -1 = invalid pick; val [S, k] float32 native logits, -inf where idx is -1), rows sorted by logit
    descending. Row i belongs to decode step native_topk_steps[i] ([S] int32, strictly ascending in
    [0, T)). Both are empty for documents dumped without stored top-k (older dumps, --store-topk none).
    """

    doc_index: int
    rid: str
    hidden: dict[int, torch.Tensor]  # L -> [T, hidden] float32
    positions: dict[int, torch.Tensor]  # L -> [T] int64
    compk: dict[int, torch.Tensor]  # L -> [N, D+4] uint8
    label_indices: torch.Tensor  # [E] int32
    label_scores: torch.Tensor  # [E] int32
    label_pointers: torch.Tensor  # [T+1] int32
    n_prompt_blocks: int
    ratio: int = 4
    native_logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (L, t) -> [n_t] float32
    topp: float = 0.6
    min_layers: int = 3
    input_ids: torch.Tensor | None = None  # [P+T] int64
    # C -> ([S,k] i32, [S,k] f32)
    native_topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    native_topk_steps: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # [S] int32

    @property
    def target_layers(self) -> list[int]:
        return sorted(self.hidden)

    @property
    def n_tokens(self) -> int:
        return int(self.label_pointers.numel()) - 1

    @property
    def n_chunks_at(self) -> torch.Tensor:
        """[T] int64: chunks visible to decode step t, (position + 1) // ratio."""
        pos = self.positions[self.target_layers[0]] if self.positions else torch.zeros(0, dtype=torch.long)
        return torch.div(pos.long() + 1, self.ratio, rounding_mode="floor")

    @property
    def n_chunks(self) -> int:
        """Chunks in the dumped keys (prompt + response)."""
        return int(next(iter(self.compk.values())).shape[0]) if self.compk else 0

    @property
    def labels(self) -> LabelsCSR:
        return LabelsCSR(self.label_indices, self.label_scores, self.label_pointers)

    def validate(self, source: str = "<memory>") -> None:
        """Raise DumpFormatError naming the key if shapes or dtypes disagree."""

        def bad(key: str, msg: str) -> DumpFormatError:
            return DumpFormatError(f"{source}: {key}: {msg}")

        if not (math.isfinite(self.topp) and 0.0 <= self.topp <= 1.0):
            raise bad("topp", f"{self.topp!r} must lie in [0, 1]")
        if self.ratio < 1 or self.min_layers < 1 or self.n_prompt_blocks < 0:
            raise bad(
                "ratio/min_layers/n_prompt_blocks",
                f"{self.ratio}/{self.min_layers}/{self.n_prompt_blocks} must be >= 1 / >= 1 / >= 0",
            )
        try:
            self.labels.validate(f"{source}: labels")
        except LabelsError as e:  # LabelsCSR may check itself on construction, without our source: add it
            raise DumpFormatError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
        T = self.n_tokens
        if set(self.hidden) != set(self.positions) or set(self.hidden) != set(self.compk):
            raise bad(
                "layers",
                f"hidden {sorted(self.hidden)}, positions {sorted(self.positions)} and compk "
                f"{sorted(self.compk)} name different target layers",
            )
        if not self.hidden:
            raise bad("layers", "no target layer in the document")
        for L in self.target_layers:
            h, p, c = self.hidden[L], self.positions[L], self.compk[L]
            if h.dim() != 2 or h.shape[0] != T:
                raise bad(f"hidden_layer_{L}", f"shape {tuple(h.shape)}, expected [T={T}, hidden]")
            if p.shape != (T,) or p.dtype != torch.int64:
                raise bad(f"positions_layer_{L}", f"{p.dtype} {tuple(p.shape)}, expected int64 [{T}]")
            if c.dim() != 2 or c.dtype != torch.uint8 or c.shape[1] < 5:
                raise bad(f"compk_layer_{L}", f"{c.dtype} {tuple(c.shape)}, expected uint8 [N, D+4]")
            L0 = self.target_layers[0]
            if c.shape != self.compk[L0].shape:
                raise bad(
                    f"compk_layer_{L}", f"shape {tuple(c.shape)} != compk_layer_{L0} {tuple(self.compk[L0].shape)}"
                )
            if h.shape != self.hidden[L0].shape:
                raise bad(
                    f"hidden_layer_{L}", f"shape {tuple(h.shape)} != hidden_layer_{L0} {tuple(self.hidden[L0].shape)}"
                )
            if not torch.equal(p, self.positions[L0]):
                raise bad(f"positions_layer_{L}", f"differs from positions_layer_{L0}")
        for L in self.target_layers:
            _check_finite(self.hidden[L], f"hidden_layer_{L}", bad)
            _check_keys(self.compk[L], f"compk_layer_{L}", bad)
        if T and int(self.n_chunks_at.max()) > self.n_chunks:
            raise bad("compk", f"{self.n_chunks} chunks but the last decode step sees {int(self.n_chunks_at.max())}")
        if self.label_indices.numel() and int(self.label_indices.max()) >= self.n_chunks:
            raise bad("label_indices", f"chunk {int(self.label_indices.max())} >= N={self.n_chunks}")
        for (L, t), lg in self.native_logits.items():
            if L not in self.hidden or not 0 <= t < T or lg.dim() != 1:
                raise bad(f"logits_layer_{L}_token_{t}", f"shape {tuple(lg.shape)} for layer {L}, T={T}")
            _check_finite(lg, f"logits_layer_{L}_token_{t}", bad)
        self._validate_topk(bad)

    def _validate_topk(self, bad) -> None:
        """Shapes, dtypes and ranges of the stored native top-k (nothing to check when none is stored)."""
        st, T = self.native_topk_steps, self.n_tokens
        if st.dim() != 1 or st.dtype != torch.int32:
            raise bad(TOPK_STEPS_KEY, f"{st.dtype} {tuple(st.shape)}, expected int32 [S]")
        S = int(st.numel())
        if S and not self.native_topk:
            raise bad(TOPK_STEPS_KEY, f"{S} stored steps but no native_topk_idx/val_layer_* tensors")
        if self.native_topk and not S:
            raise bad(
                TOPK_STEPS_KEY, f"missing or empty, but native top-k of layers {sorted(self.native_topk)} is stored"
            )
        if S and (int(st.min()) < 0 or int(st.max()) >= T or (S > 1 and bool((st[1:] <= st[:-1]).any()))):
            raise bad(
                TOPK_STEPS_KEY, f"must be strictly ascending decode steps in [0, T={T}), got {st.tolist()[:8]}..."
            )
        k0 = None
        n_vis = self.n_chunks_at[st.long()] if S and self.positions else None
        for C, (idx, val) in sorted(self.native_topk.items()):
            if idx.dim() != 2 or idx.dtype != torch.int32 or idx.shape[0] != S:
                raise bad(f"native_topk_idx_layer_{C}", f"{idx.dtype} {tuple(idx.shape)}, expected int32 [S={S}, k]")
            if val.dtype != torch.float32 or val.shape != idx.shape:
                raise bad(
                    f"native_topk_val_layer_{C}",
                    f"{val.dtype} {tuple(val.shape)}, expected float32 "
                    f"{list(idx.shape)} like native_topk_idx_layer_{C}",
                )
            k0 = idx.shape[1] if k0 is None else k0
            if idx.shape[1] != k0:
                raise bad(f"native_topk_idx_layer_{C}", f"k={idx.shape[1]} differs from the other layers' k={k0}")
            valid = idx >= 0
            if (
                bool((idx < -1).any())
                or not torch.equal(valid, val > float("-inf"))
                or bool(val.isnan().any())
                or bool((val == float("inf")).any())
            ):
                raise bad(
                    f"native_topk_idx_layer_{C}",
                    "ids must be >= 0 exactly where the value is a finite logit (-1 with -inf otherwise)",
                )
            if n_vis is not None and bool((valid & (idx.long() >= n_vis[:, None])).any()):
                raise bad(f"native_topk_idx_layer_{C}", "a chunk id is not visible at its decode step")


def _check_finite(x: torch.Tensor, key: str, bad) -> None:
    """NaN / Inf in a float tensor is an error naming the key, the count and the first bad row (where they enter)."""
    if not x.is_floating_point():
        raise bad(key, f"dtype {x.dtype}, expected a float tensor")
    ok = torch.isfinite(x)
    if not bool(ok.all()):
        n = int((~ok).sum())
        first = int((~ok).reshape(x.shape[0], -1).any(1).nonzero()[0]) if x.dim() else 0
        raise bad(key, f"{n} non-finite value(s) (NaN/Inf), first in row {first}")


def _check_keys(c: torch.Tensor, key: str, bad) -> None:
    """Index-key chunks [N, D+4] uint8 (D float8_e4m3fn bytes + a little-endian fp32 scale): a NaN fp8 byte
    (0x7F / 0xFF, e4m3fn has no inf) or a NaN/Inf scale is an error naming the key, the count and the first
    chunk, where the document enters (a key like that scores NaN and silently wrecks labels, F1 and training)."""
    if c.numel() == 0:
        return
    d = c.shape[1] - 4
    scale = c[:, d:].contiguous().view(torch.float32).reshape(-1)
    bad_scale = ~torch.isfinite(scale)
    if bool(bad_scale.any()):
        raise bad(
            key,
            f"{int(bad_scale.sum())} non-finite fp8 chunk scale(s) (NaN/Inf), first in chunk "
            f"{int(bad_scale.nonzero()[0])}",
        )
    nan8 = ((c[:, :d] & 0x7F) == 0x7F).any(1)
    if bool(nan8.any()):
        raise bad(
            key,
            f"{int(nan8.sum())} chunk(s) with a NaN fp8 key byte (0x7f/0xff), first in chunk {int(nan8.nonzero()[0])}",
        )


def topk_store_steps(n_tokens: int, mode: str, interval: int = 64) -> torch.Tensor:
    """Decode steps whose native top-k a dump stores. Returns [S] int32, ascending.

    mode "none": no step; "cycle": every t with t % interval == 0 (the cycle starts at tau = interval);
    "all": every step 0..n_tokens-1.
    """
    if mode not in STORE_TOPK_MODES:
        raise ValueError(f"store_topk={mode!r}: expected one of {', '.join(STORE_TOPK_MODES)}")
    if interval < 1:
        raise ValueError(f"topk_interval={interval}: must be >= 1")
    if mode == "none":
        return torch.zeros(0, dtype=torch.int32)
    return torch.arange(0, n_tokens, interval if mode == "cycle" else 1, dtype=torch.int32)


def native_topk_rows(logits: torch.Tensor, n_visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored top-k of some decode steps of one layer.

    logits: [S, N] float native indexer logits (any float dtype); n_visible: [S] int visible-chunk counts
    (columns >= n_visible, and non-finite logits, are not eligible). Returns (idx [S, k] int32, -1 where
    fewer than k chunks are eligible; val [S, k] float32, -inf there), sorted by logit descending.
    """
    if logits.dim() != 2 or n_visible.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} / n_visible {tuple(n_visible.shape)}: expected [S, N] / [S]")
    S, N = logits.shape
    cols = torch.arange(N, device=logits.device)
    masked = logits.float().masked_fill(cols[None, :] >= n_visible.to(logits.device).long()[:, None], float("-inf"))
    masked = masked.masked_fill(~torch.isfinite(masked), float("-inf"))
    idx = torch.full((S, k), -1, dtype=torch.int32)
    val = torch.full((S, k), float("-inf"), dtype=torch.float32)
    kk = min(k, N)
    if S and kk:
        v, i = torch.topk(masked, kk, dim=1, largest=True, sorted=True)
        ok = v > float("-inf")
        idx[:, :kk] = torch.where(ok, i, torch.full_like(i, -1)).to(torch.int32).cpu()
        val[:, :kk] = v.cpu()
    return idx, val


def _meta_int(meta: dict[str, str], key: str, source: str, default: int | None = None) -> int:
    if key not in meta:
        if default is None:
            raise DumpFormatError(f"{source}: metadata key {key!r} missing")
        return default
    try:
        return int(meta[key])
    except ValueError:
        raise DumpFormatError(f"{source}: metadata {key}={meta[key]!r} is not an integer") from None


def _meta_float(meta: dict[str, str], key: str, source: str, default: float) -> float:
    if key not in meta:
        return default
    try:
        return float(meta[key])
    except (TypeError, ValueError):
        raise DumpFormatError(f"{source}: metadata {key}={meta[key]!r} is not a number") from None


def doc_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, str], source: str) -> DumpDoc:
    """Assemble (and validate) a DumpDoc from a flat key -> tensor dict and string metadata."""
    hidden, positions, compk, logits = {}, {}, {}, {}
    topk: dict[str, dict[int, torch.Tensor]] = {"idx": {}, "val": {}}
    for k, v in tensors.items():
        if not isinstance(v, torch.Tensor):
            raise DumpFormatError(f"{source}: key {k!r} holds a {type(v).__name__}, not a tensor")
        m = _KEY_RE.match(k)
        if m:
            {"hidden": hidden, "positions": positions, "compk": compk}[m.group(1)][int(m.group(2))] = v
            continue
        m = _LOGIT_RE.match(k)
        if m:
            logits[(int(m.group(1)), int(m.group(2)))] = v.float().reshape(-1)
            continue
        m = _TOPK_RE.match(k)
        if m:
            topk[m.group(1)][int(m.group(2))] = v
    for a, b in (("idx", "val"), ("val", "idx")):
        for C in sorted(set(topk[a]) - set(topk[b])):
            raise DumpFormatError(
                f"{source}: key 'native_topk_{b}_layer_{C}' missing (native_topk_{a}_layer_{C} is present)"
            )
    for k in ("label_indices", "label_scores", "label_pointers"):
        if k not in tensors:
            raise DumpFormatError(f"{source}: key {k!r} missing")
    doc = DumpDoc(
        doc_index=_meta_int(meta, "doc_index", source),
        rid=str(meta.get("rid", "")),
        hidden={L: h.float() for L, h in hidden.items()},
        positions={L: p.long().reshape(-1) for L, p in positions.items()},
        compk={L: c.reshape(c.shape[0], math.prod(c.shape[1:])) if c.dim() > 2 else c for L, c in compk.items()},
        label_indices=tensors["label_indices"].to(torch.int32),
        label_scores=tensors["label_scores"].to(torch.int32),
        label_pointers=tensors["label_pointers"].to(torch.int32),
        n_prompt_blocks=_meta_int(meta, "n_prompt_blocks", source),
        ratio=_meta_int(meta, "ratio", source, 4),
        native_logits=logits,
        topp=_meta_float(meta, "topp", source, 0.6),
        min_layers=_meta_int(meta, "min_layers", source, 3),
        input_ids=tensors["input_ids"].long() if "input_ids" in tensors else None,
        native_topk={C: (topk["idx"][C], topk["val"][C]) for C in sorted(topk["idx"])},
        native_topk_steps=tensors.get(TOPK_STEPS_KEY, torch.zeros(0, dtype=torch.int32)),
    )
    doc.validate(source)
    return doc


def _load_pickle(p: Path) -> DumpDoc:
    try:
        with open(p, "rb") as f:
            obj = pickle.load(f)  # noqa: S301 - only reached with an explicit allow_pickle
    except Exception as e:
        raise DumpFormatError(f"{p}: unreadable pickle ({type(e).__name__}: {e}); truncated?") from e
    if not isinstance(obj, dict):
        raise DumpFormatError(f"{p}: expected a dict of tensors, got {type(obj).__name__}")
    m = _DOC_RE.match(p.name)
    meta = {"doc_index": m.group(1) if m else "0"}
    for _, line in metadata_lines(p.parent):  # upstream keeps rid / n_prompt_blocks only in the jsonl
        if line.get("filename") == p.name:
            meta.update({k: str(v) for k, v in line.items() if not isinstance(v, (dict, list))})
    meta.setdefault("n_prompt_blocks", "0")
    return doc_from_tensors(dict(obj), meta, str(p))


def load_doc(path: str | os.PathLike, allow_pickle: bool = False) -> DumpDoc:
    """Load one document. `.pkl` (upstream) files are refused unless allow_pickle=True."""
    p = Path(path)
    if not p.is_file():
        raise DumpFormatError(f"{p}: no such file")
    if p.suffix == ".pkl":
        if not allow_pickle:
            raise DumpFormatError(
                f"{p}: refusing to unpickle an upstream dump file (unpickling runs code from "
                "the file). Pass allow_pickle=True / --allow-pickle only if you trust it."
            )
        return _load_pickle(p)
    if p.suffix != ".safetensors":
        raise DumpFormatError(f"{p}: unknown dump file type {p.suffix!r} (expected .safetensors or .pkl)")
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a short or corrupt file
        raise DumpFormatError(f"{p}: unreadable safetensors file ({type(e).__name__}: {e}); truncated?") from e
    if meta.get("format") != FORMAT:
        raise DumpFormatError(f"{p}: metadata format={meta.get('format')!r}, expected {FORMAT!r}")
    return doc_from_tensors(tensors, meta, str(p))
