"""Initialise a retriever from native DeepSeek-V4 weights (attention q-LoRA + lightning indexer).

Per c4 layer the retriever needs four native tensors of model layer i = c4_layers[id]:

  retriever          official name                          HF (transformers) name
  wq_a.weight        layers.{i}.attn.wq_a.weight            model.layers.{i}.self_attn.q_a_proj.weight
  q_norm_weight      layers.{i}.attn.q_norm.weight          model.layers.{i}.self_attn.q_a_norm.weight
  wq_b.weight        layers.{i}.attn.indexer.wq_b.weight    ...self_attn.compressor.indexer.q_b_proj.weight
  weights_proj       layers.{i}.attn.indexer.weights_proj   ...self_attn.compressor.indexer.scorer.weights_proj

Keys are matched by pattern (any prefix), so `model.`-prefixed and bare names both work, and also
upstream's extracted `layer_{i:02d}.safetensors` files with bare `wq_a.weight` ... keys. fp8 weights
are dequantized with their 128x128 block scales (`<name>.scale` official, `<name>_scale_inv` HF).
The c4 layers are the layers whose compress ratio is 4, in config order (`compress_ratios` or
`layer_types` in config.json); without a config, DeepSeek-V4-Flash's 2, 4, ..., 42 is assumed.

Larger retrievers than the native indexer (more heads, larger q-LoRA rank) copy the native block
into the leading heads / rank dims and keep the module's random init for the rest (q_norm: 1).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from flashmemory.errors import UserError
from flashmemory.retriever.model import JointRetriever

NATIVE = {
    "wq_a.weight": r"(?:attn\.wq_a|self_attn\.q_a_proj)\.weight",
    "q_norm_weight": r"(?:attn\.q_norm|self_attn\.q_a_norm)\.weight",
    "wq_b.weight": r"(?:attn\.indexer\.wq_b|self_attn\.compressor\.indexer\.q_b_proj)\.weight",
    "weights_proj.weight": (
        r"(?:attn\.indexer\.weights_proj"
        r"|self_attn\.compressor\.indexer\.scorer\.weights_proj)\.weight"
    ),
}
EXTRACTED = {
    "wq_a.weight": "wq_a.weight",
    "q_norm_weight": "q_norm.weight",
    "wq_b.weight": "indexer.wq_b.weight",
    "weights_proj.weight": "indexer.weights_proj.weight",
}
FP8_BLOCK = 128


class NativeWeightError(UserError):
    """Native weights are missing, ambiguous or shaped unlike a DeepSeek-V4 indexer."""


def c4_layers_from_config(cfg: dict) -> list[int]:
    """Model layer ids of the c4 (compress ratio 4) layers, in order; position = c4 layer id."""
    if "compress_ratios" in cfg:
        return [i for i, r in enumerate(cfg["compress_ratios"][: cfg.get("num_hidden_layers")]) if r == 4]
    if "layer_types" in cfg:
        return [i for i, t in enumerate(cfg["layer_types"]) if t == "compressed_sparse_attention"]
    raise NativeWeightError("config has neither compress_ratios nor layer_types")


def _tensor_index(weight_dir: Path) -> dict[str, Path]:
    files = sorted(weight_dir.glob("*.safetensors"))
    if not files:
        raise NativeWeightError(f"{weight_dir}: no *.safetensors files")
    idx_file = weight_dir / "model.safetensors.index.json"
    if idx_file.is_file():
        wm = json.loads(idx_file.read_text()).get("weight_map", {})
        return {k: weight_dir / v for k, v in wm.items()}
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp8 [R, C] with block scales [ceil(R/b), ceil(C/b)] (multipliers) -> fp32 [R, C]."""
    r, c = w.shape
    s = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:r, :c]
    return w.float() * s


class NativeWeights:
    """Finds and reads native indexer tensors from a dir of safetensors shards or an in-memory state dict."""

    def __init__(self, source: str | Path | dict[str, torch.Tensor]):
        if isinstance(source, dict):
            self.state, self.index, self.dir, self.cfg = source, None, None, None
        else:
            self.dir = Path(source)
            if not self.dir.is_dir():
                raise NativeWeightError(f"--weight-dir {self.dir}: no such directory")
            self.state = None
            self.index = _tensor_index(self.dir)
            cfg_file = self.dir / "config.json"
            self.cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else None

    def keys(self) -> list[str]:
        return list(self.state) if self.state is not None else list(self.index)

    def _get(self, key: str) -> torch.Tensor:
        if self.state is not None:
            return self.state[key]
        from safetensors import safe_open

        with safe_open(str(self.index[key]), framework="pt") as h:
            return h.get_tensor(key)

    def c4_layers(self) -> list[int]:
        if self.cfg is not None:
            return c4_layers_from_config(self.cfg)
        return [2 + 2 * i for i in range(21)]

    def _find(self, param: str, model_layer: int) -> str:
        keys = self.keys()
        pat = re.compile(rf"(?:^|\.)layers\.{model_layer}\.{NATIVE[param]}$")
        hits = [k for k in keys if pat.search(k)]
        if not hits:  # upstream's extracted per-layer files: bare keys in layer_{i:02d}.safetensors
            want = EXTRACTED[param]
            hits = [
                k
                for k in keys
                if k == want and self.index is not None and self.index[k].name == f"layer_{model_layer:02d}.safetensors"
            ]
        if len(hits) != 1:
            what = "no key" if not hits else f"several keys {hits[:4]}"
            raise NativeWeightError(
                f"{self.dir or 'state dict'}: {what} for {param} of model layer {model_layer} "
                f"(pattern layers.{model_layer}.{NATIVE[param]})"
            )
        return hits[0]

    def layer(self, model_layer: int) -> dict[str, torch.Tensor]:
        """The four native tensors of one model layer, fp32, keyed by retriever parameter name."""
        out = {}
        for param in NATIVE:
            key = self._find(param, model_layer)
            w = self._get(key)
            if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                base = key[: -len(".weight")]
                cands = [
                    c
                    for c in (base + ".scale", key + "_scale_inv", base + ".weight_scale_inv")
                    if c in set(self.keys())
                ]
                if not cands:
                    raise NativeWeightError(
                        f"{key} is {w.dtype} but has no block scale ({base}.scale or {key}_scale_inv)"
                    )
                w = dequantize_fp8(w, self._get(cands[0]))
            out[param] = w.float()
        return out


def copy_native(model: JointRetriever, native: NativeWeights) -> dict[int, str]:
    """Copy native weights into every retriever layer (in place). Returns {c4 id: note}.

    The native heads' wq_b columns past the native rank are zeroed, so at init they read only the
    native rank dims (the RMSNorm still sees the extra random dims)."""
    c4 = native.c4_layers()
    notes = {}
    d = model.dims
    for lid in model.layers:
        if not 0 <= lid < len(c4):
            raise NativeWeightError(f"retriever layer c4 id {lid}: the model has only {len(c4)} c4 layers")
        w = native.layer(c4[lid])
        rank_n, hidden_n = w["wq_a.weight"].shape
        heads_n = w["weights_proj.weight"].shape[0]
        if hidden_n != d.hidden or w["wq_b.weight"].shape != (heads_n * d.head_dim, rank_n):
            raise NativeWeightError(
                f"model layer {c4[lid]}: native wq_a {tuple(w['wq_a.weight'].shape)}, wq_b "
                f"{tuple(w['wq_b.weight'].shape)}, weights_proj {tuple(w['weights_proj.weight'].shape)} do not fit "
                f"a retriever with hidden {d.hidden}, head_dim {d.head_dim}"
            )
        r, h = min(rank_n, d.rank), min(heads_n, d.n_heads)
        layer = model.layer(lid)
        with torch.no_grad():
            layer.wq_a.weight[:r] = w["wq_a.weight"][:r]
            layer.q_norm_weight[:r] = w["q_norm_weight"][:r]
            wq_b = layer.wq_b.weight.view(d.n_heads, d.head_dim, d.rank)
            wq_b[:h, :, :r] = w["wq_b.weight"].view(heads_n, d.head_dim, rank_n)[:h, :, :r]
            wq_b[:h, :, r:] = 0.0
            layer.weights_proj.weight[:h] = w["weights_proj.weight"][:h]
        notes[lid] = f"model layer {c4[lid]}: native {heads_n} heads x rank {rank_n} -> {d.n_heads} x {d.rank}"
    return notes
