"""A synthetic golden-label dump with a known teacher, for tests and smoke runs without a model.

A random "teacher" retriever plays the native indexer: its logits over the chunks that exist at
each decode step give the golden labels (nucleus votes over the target layers, as the dump does)
and the stored `native_logits`. Its weights can be written as a native DeepSeek-V4 checkpoint dir
(official key names + config.json) so native init and `verify` can be checked against it.
Documents are written with the real dump writer, so they are genuine `flashmemory-dump/1` files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashmemory.dump.format import DumpDoc
from flashmemory.dump.writer import DumpWriter
from flashmemory.labels import golden_labels
from flashmemory.retriever.fp8 import dequantize_chunks, quantize_chunks
from flashmemory.retriever.model import JointRetriever, RetrieverDims

TEACHER_DIMS = RetrieverDims(hidden=64, rank=32, n_heads=8, head_dim=32, rope_dim=16)


def make_teacher(
    layers: tuple[int, ...] = (0, 1), dims: RetrieverDims = TEACHER_DIMS, seed: int = 0, sharpness: float = 8.0
) -> JointRetriever:
    """A random joint retriever whose logits are peaky enough (weights_proj scaled up) to give labels."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        t = JointRetriever(layers, dims)
        with torch.no_grad():
            for lid in t.layers:
                t.layer(lid).weights_proj.weight.mul_(sharpness)
    return t.eval()


@torch.no_grad()
def make_doc(
    teacher: JointRetriever,
    doc_index: int,
    prompt_len: int,
    n_tokens: int,
    seed: int,
    topk: int = 4,
    topp: float = 0.5,
    min_layers: int = 1,
    ratio: int = 4,
) -> DumpDoc:
    g = torch.Generator().manual_seed(seed)
    d = teacher.dims
    n_chunks = (prompt_len + n_tokens) // ratio
    positions = prompt_len + torch.arange(n_tokens)
    n_vis = torch.div(positions + 1, ratio, rounding_mode="floor")
    hidden, compk, logits = {}, {}, {}
    for L in teacher.layers:
        # A doc-level query direction plus per-step drift: consecutive steps want similar chunks,
        # so lookahead windows are learnable, as in real decoding.
        base = torch.randn(1, d.hidden, generator=g)
        drift = torch.cumsum(torch.randn(n_tokens, d.hidden, generator=g), 0) * 0.05
        hidden[L] = (base + drift + 0.3 * torch.randn(n_tokens, d.hidden, generator=g)).to(torch.bfloat16).float()
        compk[L] = quantize_chunks(torch.randn(n_chunks, d.head_dim, generator=g))
        keys = dequantize_chunks(compk[L])
        logits[L] = teacher.layer(L).logits(hidden[L], positions, keys, n_vis)
    labels = golden_labels(
        [logits[L] for L in teacher.layers], topk=topk, topp=topp, min_layers=min_layers, n_visible=n_vis
    )
    native = {(L, t): logits[L][t, : int(n_vis[t])].clone() for L in teacher.layers for t in range(min(3, n_tokens))}
    return DumpDoc(
        doc_index=doc_index,
        rid=f"synthetic-{doc_index}",
        hidden=hidden,
        positions={L: positions.clone() for L in teacher.layers},
        compk=compk,
        label_indices=labels.indices,
        label_scores=labels.scores,
        label_pointers=labels.pointers,
        n_prompt_blocks=prompt_len // ratio,
        ratio=ratio,
        native_logits=native,
        topp=topp,
        min_layers=min_layers,
    )


def write_synthetic_dump(
    out_dir: str | Path,
    teacher: JointRetriever,
    n_docs: int = 4,
    prompt_len: int = 256,
    n_tokens: int = 48,
    seed: int = 0,
) -> list[Path]:
    """Write `n_docs` documents (prompt lengths vary by doc) with the dump writer; returns their paths."""
    w = DumpWriter(out_dir)
    paths = []
    for i in range(n_docs):
        doc = make_doc(teacher, w.next_doc_index, prompt_len + 32 * i, n_tokens, seed=seed * 1000 + i)
        rec = w.commit(doc)
        paths.append(Path(out_dir) / rec["filename"])
    return paths


def write_native_checkpoint(out_dir: str | Path, teacher: JointRetriever, fp8_wq_a: bool = False) -> Path:
    """Write the teacher as native DeepSeek-V4 weights: config.json (compress_ratios [0, 0, 4, 128, 4, ...])
    and one shard with official names `layers.{i}.attn.{wq_a,q_norm,indexer.wq_b,indexer.weights_proj}`.
    fp8_wq_a stores wq_a as float8_e4m3fn with a 128x128 block `.scale`, like the released checkpoint."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_c4 = max(teacher.layers) + 1
    ratios = [0, 0] + [4, 128] * n_c4 + [0]
    c4 = [i for i, r in enumerate(ratios) if r == 4]
    (out / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": len(ratios), "compress_ratios": ratios})
    )
    state = {}
    for lid in teacher.layers:
        layer, i = teacher.layer(lid), c4[lid]
        wq_a = layer.wq_a.weight.detach().float()
        if fp8_wq_a:
            s = wq_a.abs().amax().clamp_min(1e-8) / 448.0
            state[f"layers.{i}.attn.wq_a.weight"] = (wq_a / s).to(torch.float8_e4m3fn)
            nb = ((wq_a.shape[0] + 127) // 128, (wq_a.shape[1] + 127) // 128)
            state[f"layers.{i}.attn.wq_a.scale"] = torch.full(nb, float(s))
        else:
            state[f"layers.{i}.attn.wq_a.weight"] = wq_a.contiguous()
        state[f"layers.{i}.attn.q_norm.weight"] = layer.q_norm_weight.detach().float().contiguous()
        state[f"layers.{i}.attn.indexer.wq_b.weight"] = layer.wq_b.weight.detach().float().contiguous()
        state[f"layers.{i}.attn.indexer.weights_proj.weight"] = layer.weights_proj.weight.detach().float().contiguous()
    save_file(state, str(out / "model-00001-of-00001.safetensors"))
    return out
