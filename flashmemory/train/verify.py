"""`flashmemory verify`: check scoring math against a dump.

Native mode (--model NAME|DIR or --weight-dir DIR): rebuild each target layer's NATIVE lightning
indexer from model weights (attention q_a_proj + q_a_norm, indexer q_b_proj + weights_proj) as a
`RetrieverLayer`, score the dumped hidden state of the first decode steps against the dumped keys,
and compare with the dumped `logits_layer_{L}_token_{t}`. The dumped keys are Hadamard-rotated and
fp8-quantized (sglang's index-K layout); Hadamard is orthogonal, so rotating q the same way keeps
q.k, and the retriever's query path applies exactly that rotation after YaRN RoPE (compress rope:
theta `compress_rope_theta`, rope dims `qk_rope_head_dim`, interleaved, no mscale; transformers'
indexer applies the same RoPE to q before its scorer). Pearson r and top-K overlap (K in 10, 50,
512, clipped to n) per (doc, layer, step); PASS needs r >= 0.95 everywhere.

Checkpoint mode (--checkpoint CKPT): a trained retriever's fp32 logits on the dump vs an
independent float64 reference written out here (explicit Hadamard matrix, explicit rotation).

A dump made by the hf backend records its `model` and `seed` in every metadata line. Native mode with a
seeded random model (a shipped name or a .json config) refuses a --seed the dump was not made with, and a
FAIL line names the dump's model and seed (or says the dump records none: an older dump).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from flashmemory.retriever.fp8 import FP8, FP8_MAX, dequantize_chunks
from flashmemory.retriever.hadamard import hadamard_matrix
from flashmemory.retriever.model import RetrieverDims, RetrieverLayer
from flashmemory.retriever.rope import RopeConfig, rope_angles

TOPK = (10, 50, 512)
PASS_R = 0.95
MAX_SEED = 2**63 - 1  # as `flashmemory dump --seed`


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den > 0 else float("nan")


def topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    k = min(k, a.numel())
    if k == 0:
        return float("nan")
    ia, ib = set(torch.topk(a, k).indices.tolist()), set(torch.topk(b, k).indices.tolist())
    return len(ia & ib) / k


def rope_from_model_config(cfg: dict, head_dim: int) -> RopeConfig:
    """The compressed-layer YaRN RoPE of a DeepSeek-V4 config.json (official keys)."""
    rs = cfg.get("rope_scaling") or {}
    rope_dim = int(cfg.get("qk_rope_head_dim") or (64 if head_dim >= 128 else head_dim // 2))
    return RopeConfig(
        rope_dim=rope_dim,
        theta=float(cfg.get("compress_rope_theta", 160000.0)),
        factor=float(rs.get("factor", 16.0)),
        original_len=int(rs.get("original_max_position_embeddings", 65536)),
        beta_fast=float(rs.get("beta_fast", 32.0)),
        beta_slow=float(rs.get("beta_slow", 1.0)),
        max_position=int(cfg.get("max_position_embeddings", 1048576)),
    )


def native_source(a: argparse.Namespace):
    """(NativeWeights, config dict) from --model (shipped name or HF dir) or --weight-dir."""
    from flashmemory.train.native_init import NativeWeights

    if a.weight_dir:
        nw = NativeWeights(a.weight_dir)
        if nw.cfg is None:
            raise FileNotFoundError(f"--weight-dir {a.weight_dir}: config.json needed for the RoPE parameters")
        return nw, nw.cfg
    from flashmemory.hf.models import config_dict, load_model, shipped_configs

    model, config = load_model(a.model, seed=a.seed)
    nw = NativeWeights(model.state_dict())
    nw.cfg = {"layer_types": list(config.layer_types)}
    if a.model in shipped_configs():
        raw = config_dict(a.model)
    else:
        raw = json.loads((Path(a.model) / "config.json").read_text())
    return nw, raw


def native_layer(nw, raw_cfg: dict, c4_id: int, head_dim: int) -> RetrieverLayer:
    c4 = nw.c4_layers()
    if not 0 <= c4_id < len(c4):
        raise ValueError(f"c4 layer {c4_id}: the model has {len(c4)} c4 layers")
    w = nw.layer(c4[c4_id])
    rank, hidden = w["wq_a.weight"].shape
    dims = RetrieverDims(
        hidden=hidden,
        rank=rank,
        n_heads=w["weights_proj.weight"].shape[0],
        head_dim=head_dim,
        rope_dim=rope_from_model_config(raw_cfg, head_dim).rope_dim,
    )
    layer = RetrieverLayer(dims, rope_from_model_config(raw_cfg, head_dim))
    with torch.no_grad():
        for k, v in w.items():
            layer.get_parameter(k).copy_(v)
    return layer.eval()


@torch.no_grad()
def native_logits(
    layer: RetrieverLayer, hidden: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, fp8_q: bool = False
) -> torch.Tensor:
    """[B, n] native logits; fp8_q quantizes q per head (scale amax/448) as sglang's indexer does."""
    q, w = layer.query(hidden, pos)
    if fp8_q:
        s = q.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        q = (q / s).to(FP8).float() * s
    return torch.einsum("bhd,nd->bhn", q, keys).relu().mul(w.unsqueeze(-1)).sum(1)


def verify_native(a: argparse.Namespace, docs: list) -> list[dict]:
    nw, raw = native_source(a)
    rows, layers = [], {}
    for doc in docs:
        head_dim = next(iter(doc.compk.values())).shape[1] - 4
        for (L, t), ref in sorted(doc.native_logits.items()):
            if L not in layers:
                layers[L] = native_layer(nw, raw, L, head_dim)
            n = ref.numel()
            keys = dequantize_chunks(doc.compk[L][:n])
            got = native_logits(layers[L], doc.hidden[L][t : t + 1], doc.positions[L][t : t + 1], keys, a.fp8_q)[0]
            rows.append(
                {
                    "doc": doc.doc_index,
                    "layer": L,
                    "t": t,
                    "n": n,
                    "r": pearson(got, ref),
                    **{f"top{k}": topk_overlap(got, ref, k) for k in TOPK},
                }
            )
    return rows


@torch.no_grad()
def reference_logits(
    sd: dict[str, torch.Tensor],
    rope: RopeConfig,
    hidden: torch.Tensor,
    pos: torch.Tensor,
    keys: torch.Tensor,
    n_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Float64 retriever logits written out step by step: [B, n]."""
    x = hidden.double()
    ql = x @ sd["wq_a.weight"].double().T
    ql = ql / torch.sqrt((ql * ql).mean(-1, keepdim=True) + 1e-6) * sd["q_norm_weight"].double()
    q = (ql @ sd["wq_b.weight"].double().T).view(-1, n_heads, head_dim)
    ang = rope_angles(pos, rope).unsqueeze(1)  # [B, 1, rope/2] float64
    rot = q[..., head_dim - rope.rope_dim :]
    re, im = rot[..., 0::2], rot[..., 1::2]
    out = torch.empty_like(rot)
    out[..., 0::2] = re * ang.cos() - im * ang.sin()
    out[..., 1::2] = re * ang.sin() + im * ang.cos()
    q = torch.cat((q[..., : head_dim - rope.rope_dim], out), -1) @ (hadamard_matrix(head_dim) / math.sqrt(head_dim))
    w = (x @ sd["weights_proj.weight"].double().T) * (head_dim**-0.5 * n_heads**-0.5)
    return torch.einsum("bhd,nd->bhn", q, keys.double()).relu().mul(w.unsqueeze(-1)).sum(1)


def verify_checkpoint(a: argparse.Namespace, docs: list) -> list[dict]:
    from flashmemory.retriever.checkpoint import PARAMS, load_retriever

    model = load_retriever(a.checkpoint).eval()
    rows = []
    for doc in docs:
        steps = list(range(min(a.steps, doc.n_tokens)))
        for L in model.layers:
            layer = model.layer(L)
            sd = {k: layer.get_parameter(k).detach() for k in PARAMS}
            for t in steps:
                n = min(int(doc.n_chunks_at[t]), doc.n_chunks)
                keys = dequantize_chunks(doc.compk[L][:n])
                h, p = doc.hidden[L][t : t + 1], doc.positions[L][t : t + 1]
                with torch.no_grad():
                    got = layer.logits(h, p, keys)[0] - layer.logit_offset
                ref = reference_logits(sd, model.rope, h, p, keys, model.dims.n_heads, model.dims.head_dim)[0]
                err = float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                rows.append(
                    {
                        "doc": doc.doc_index,
                        "layer": L,
                        "t": t,
                        "n": n,
                        "r": pearson(got, ref),
                        "max_rel_err": err,
                        **{f"top{k}": topk_overlap(got, ref.float(), k) for k in TOPK},
                    }
                )
    return rows


def dump_provenance(dump: str, paths: list[Path]) -> set[tuple[str, int]]:
    """(model, seed) pairs the metadata lines of `paths` record (hf dumps; empty for older or sglang dumps)."""
    from flashmemory.dump.format import read_metadata

    names = {p.name for p in paths}
    return {
        (str(r["model"]), r["seed"])
        for r in read_metadata(dump)
        if r["filename"] in names and "model" in r and isinstance(r.get("seed"), int)
    }


def seed_problem(a: argparse.Namespace, made: set[tuple[str, int]]) -> str | None:
    """Why --model/--seed cannot reproduce the dump's native logits, or None (nothing recorded, or a match)."""
    if not a.model or a.weight_dir or not made:
        return None
    seeds = sorted(s for m, s in made if m == a.model)
    seeded = not Path(a.model).is_dir()  # a checkpoint directory ignores the seed
    if seeded and seeds and a.seed not in seeds:
        return (
            f"--seed {a.seed}: the dump {a.dump} was made with --model {a.model} --seed "
            f"{' / '.join(map(str, seeds))} (server_metadata.jsonl); its native logits come from that random "
            f"model, so pass --seed {seeds[0]}"
        )
    return None


def fail_reason(a: argparse.Namespace, made: set[tuple[str, int]]) -> str:
    """What a native-mode FAIL line adds: the dump's recorded model and seed, or that it records none."""
    if a.checkpoint or a.weight_dir:
        return ""
    if not made:
        return (
            "; the dump records no model/seed (an older or sglang dump): check that --model and --seed are the "
            "ones it was made with"
        )
    if (a.model, a.seed) in made or any(m == a.model and Path(a.model).is_dir() for m, _ in made):
        return ""  # the dump's own model and seed: the mismatch is real
    pairs = ", ".join(f"--model {m} --seed {s}" for m, s in sorted(made))
    return f"; the dump was made with {pairs}, not --model {a.model} --seed {a.seed}"


def run(a: argparse.Namespace) -> int:
    from flashmemory.dump.format import DumpFormatError, list_docs, load_doc

    modes = [x for x in (a.model, a.weight_dir, a.checkpoint) if x]
    if len(modes) != 1:
        print(
            "flashmemory verify: error: give exactly one of --model, --weight-dir (native mode) or --checkpoint",
            file=sys.stderr,
        )
        return 2
    if not 0 <= a.seed <= MAX_SEED:
        print(f"flashmemory verify: error: --seed {a.seed} must lie in [0, {MAX_SEED}] (2**63 - 1)", file=sys.stderr)
        return 2
    try:
        paths = list_docs(a.dump)[: a.max_docs]
        docs = [load_doc(p, allow_pickle=a.allow_pickle) for p in paths]
        if not docs:
            raise DumpFormatError(f"{a.dump}: no complete documents")
        made = dump_provenance(a.dump, paths)
        why = seed_problem(a, made)
        if why:
            raise ValueError(why)
        rows = verify_checkpoint(a, docs) if a.checkpoint else verify_native(a, docs)
    except (DumpFormatError, ValueError, FileNotFoundError, KeyError) as e:
        print(f"flashmemory verify: error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"flashmemory verify: error: {a.dump} has no dumped native logits to compare", file=sys.stderr)
        return 2
    print(f"{'doc':>5} {'layer':>5} {'t':>3} {'n':>6} {'r':>8} " + " ".join(f"{'top' + str(k):>7}" for k in TOPK))
    for r in rows:
        print(
            f"{r['doc']:>5} {r['layer']:>5} {r['t']:>3} {r['n']:>6} {r['r']:8.5f} "
            + " ".join(f"{r[f'top{k}']:7.3f}" for k in TOPK)
        )
    min_r = min(r["r"] for r in rows)
    need = PASS_R if not a.checkpoint else 0.9999
    ok = not math.isnan(min_r) and min_r >= need
    if a.checkpoint:
        worst = max(r["max_rel_err"] for r in rows)
        ok = ok and worst < 1e-4
        print(f"max relative error vs float64: {worst:.2e}")
    print(
        f"{'PASS' if ok else 'FAIL'}: min r = {min_r:.5f} over {len(rows)} rows (need >= {need})"
        + ("" if ok else fail_reason(a, made))
    )
    return 0 if ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check native indexer logits or a retriever checkpoint against a dump",
        description=__doc__.split("\n\n")[0] + " Native mode needs --model or --weight-dir; "
        "checkpoint mode needs --checkpoint.",
    )
    p.add_argument("--dump", required=True, help="dump directory")
    p.add_argument("--model", default=None, help="native mode: shipped model name (micro, tiny-flash) or HF model dir")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of a shipped random model (must match the dump's; a dump records it, and a mismatch is refused)",
    )
    p.add_argument(
        "--weight-dir", default=None, help="native mode: dir of DeepSeek-V4 safetensors shards + config.json"
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint mode: a retriever checkpoint")
    p.add_argument("--max-docs", type=int, default=4, help="documents to check (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="checkpoint mode: decode steps per doc (default %(default)s)")
    p.add_argument("--fp8-q", action="store_true", help="native mode: quantize q to fp8 per head like sglang")
    p.add_argument("--allow-pickle", action="store_true", help="read upstream .pkl docs (runs pickled code)")
    p.set_defaults(func=run)
