"""A trained tiny DeepSeek-V4 (and its retriever) zero-padded into the geometry sglang 0.5.23 serves.

sglang fixes the attention head at 512 = 448 nope + 64 rope (its 584-B KV entry) and the indexer head at 128 (its
132-B index-K entry). A model trained narrower (the shipped `dsv4-retrieval`: head 128 = 96 + 32, index head
64 = 32 + 32) is widened here without changing its function (`pad_math` has the rules): every weight that writes
or reads a head is scattered onto the wider layout, each RMSNorm over a padded head sees the source's mean square
(its input projection and its weights rescaled), the indexer's `weights_proj` takes the change of its 1/sqrt(head)
scale, and the compressed layers' YaRN betas are chosen so each source frequency stays exactly where its pair
lands. The rest (hidden 128, 4 heads, MoE, mHC,
window, vocabulary) is copied.

`pad_model(src, config, index_topk)` -> (padded transformers model, official-style config dict): pure, in memory.
`pad_retriever(retriever, src_config)` -> the retriever reading the padded model's 128-wide index keys (its q
heads padded as the indexer's, its weights_proj x sqrt(2), the same YaRN betas).
The test (`tests/hf/test_pad.py`) holds the padded model's fp32 logits to the source's through `HFEngine`.
"""

from __future__ import annotations

import copy
import re

import torch

from flashmemory.hf.pad_math import HeadPad, channel_map, head_rows, scatter_axis, yarn_betas

HEAD_DIM = 512  # sglang 0.5.23: deepseek_v4_memory_pool.py:313 (584-B entry), deepseek_v4_backend.py:1249
ROPE_DIM = 64
INDEX_HEAD_DIM = 128  # dsv4/indexer.py:97,223; compressor_v2.py:90 tells the indexer's compressor by it
SERVABLE_TOPK = (512, 1024)  # deepseek_v4_backend.py:881
MAX_POSITIONS = 65536  # sglang precomputes [max_position, rope/2] complex rope tables per layer


def head_pads(config) -> tuple[HeadPad, HeadPad]:
    """(attention head, index head) of a transformers `DeepseekV4Config` padded to sglang's widths; the index
    head's rope is the attention's (the indexer shares the compressed layers' rope)."""
    rope = int(config.qk_rope_head_dim)
    head, ihead = int(config.head_dim), int(config.index_head_dim)
    if rope > ROPE_DIM or ROPE_DIM % rope or head > HEAD_DIM or ihead > INDEX_HEAD_DIM or rope > ihead:
        raise ValueError(
            f"head {head} (rope {rope}) / index head {ihead} cannot pad to {HEAD_DIM} (rope {ROPE_DIM}) / "
            f"{INDEX_HEAD_DIM}: rope must divide {ROPE_DIM} and no width may exceed sglang's"
        )
    attn = HeadPad(head - rope, rope, HEAD_DIM - ROPE_DIM, ROPE_DIM)
    index = HeadPad(ihead - rope, rope, INDEX_HEAD_DIM - ROPE_DIM, ROPE_DIM)
    return attn, index


def compress_rope(config) -> dict:
    """The compressed layers' YaRN parameters of the source config: {rope_theta, factor,
    original_max_position_embeddings, beta_fast, beta_slow}."""
    rp = dict(config.rope_parameters["compress"])
    if rp.get("rope_type", rp.get("type")) != "yarn":
        raise ValueError(f"compress rope is {rp.get('rope_type')!r}; only YaRN is padded")
    if float(rp.get("attention_factor", 1.0)) != 1.0:
        raise ValueError("compress rope attention_factor != 1 (sglang's DeepSeek-V4 rope has no mscale)")
    return {
        "rope_theta": float(rp["rope_theta"]),
        "factor": float(rp["factor"]),
        "original_max_position_embeddings": int(rp["original_max_position_embeddings"]),
        "beta_fast": float(rp.get("beta_fast") or 32),
        "beta_slow": float(rp.get("beta_slow") or 1),
    }


def padded_betas(config) -> tuple[float, float]:
    """(beta_fast, beta_slow) of the padded compressed rope (`pad_math.yarn_betas`)."""
    rp = compress_rope(config)
    return yarn_betas(
        int(config.qk_rope_head_dim),
        ROPE_DIM,
        rp["rope_theta"],
        rp["original_max_position_embeddings"],
        rp["beta_fast"],
        rp["beta_slow"],
    )


_COMPRESS_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def padded_config(config, index_topk: int) -> dict:
    """The official-style config.json (the keys sglang reads; transformers maps them) of the padded model."""
    rp = compress_rope(config)
    bf, bs = padded_betas(config)
    n_hash = sum(t == "hash_moe" for t in config.mlp_layer_types)
    if list(config.mlp_layer_types) != ["hash_moe"] * n_hash + ["moe"] * (len(config.mlp_layer_types) - n_hash):
        raise ValueError(f"mlp_layer_types {config.mlp_layer_types}: hash layers must come first")
    ratios = [_COMPRESS_RATIO[t] for t in config.layer_types]
    csa, hca = (
        config.compress_rates["compressed_sparse_attention"],
        config.compress_rates["heavily_compressed_attention"],
    )
    if (csa, hca) != (4, 128):
        raise ValueError(f"compress rates {csa}/{hca}: sglang serves 4/128")
    window = int(config.sliding_window)
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": int(config.vocab_size),
        "hidden_size": int(config.hidden_size),
        "moe_intermediate_size": int(config.moe_intermediate_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "num_attention_heads": int(config.num_attention_heads),
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "qk_nope_head_dim": HEAD_DIM - ROPE_DIM,
        "q_lora_rank": int(config.q_lora_rank),
        "o_lora_rank": int(config.o_lora_rank),
        "o_groups": int(config.o_groups),
        "n_routed_experts": int(config.n_routed_experts),
        "n_shared_experts": int(config.n_shared_experts),
        "num_experts_per_tok": int(config.num_experts_per_tok),
        "num_hash_layers": n_hash,
        "n_hash_layers": n_hash,
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": config.scoring_func,
        "topk_method": config.topk_method,
        "norm_topk_prob": bool(config.norm_topk_prob),
        "routed_scaling_factor": float(config.routed_scaling_factor),
        "swiglu_limit": float(config.swiglu_limit),
        "hidden_act": config.hidden_act,
        "index_n_heads": int(config.index_n_heads),
        "index_head_dim": INDEX_HEAD_DIM,
        "index_topk": int(index_topk),
        "sliding_window": window,
        "window_size": window,
        "compress_ratios": ratios,
        "compress_rope_theta": rp["rope_theta"],
        "rope_theta": float(config.rope_parameters["main"]["rope_theta"]),
        "rope_scaling": {
            "type": "yarn",
            "factor": rp["factor"],
            "original_max_position_embeddings": rp["original_max_position_embeddings"],
            "beta_fast": bf,
            "beta_slow": bs,
        },
        "max_position_embeddings": MAX_POSITIONS,
        "hc_mult": int(config.hc_mult),
        "hc_sinkhorn_iters": int(config.hc_sinkhorn_iters),
        "hc_eps": float(config.hc_eps),
        "rms_norm_eps": float(config.rms_norm_eps),
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "initializer_range": float(config.initializer_range),
        "torch_dtype": "bfloat16",
    }


def _pad_param(name: str, t: torch.Tensor, attn: HeadPad, index: HeadPad, n_heads: int, n_iheads: int, groups: int):
    """The padded value of one transformers parameter (`name` without the `model.layers.N.` prefix), or `t`.

    A projection that feeds an RMSNorm over a padded head is multiplied by g = 1 / norm_scale and the norm's
    weights by norm_scale: the padded vector's mean square is then the source's, eps included, so the norm's
    output is exactly the source's (times g before a weightless norm: the attention's q, whose 1/sqrt(head) scale
    drops by the same g)."""
    ga, gi = 1 / attn.norm_scale(), 1 / index.norm_scale()
    idx2, att2 = head_rows(index, 1, 2), 2 * index.dst
    rules: tuple[tuple[str, object], ...] = (
        (r"self_attn\.compressor\.indexer\.kv_proj\.weight", lambda: scatter_axis(t * gi, 0, idx2, att2)),
        (r"self_attn\.compressor\.indexer\.gate_proj\.weight", lambda: scatter_axis(t, 0, idx2, att2)),
        (r"self_attn\.compressor\.indexer\.position_bias", lambda: scatter_axis(t, 1, idx2, att2)),
        (
            r"self_attn\.compressor\.indexer\.kv_norm\.weight",
            lambda: scatter_axis(t / gi, 0, channel_map(index), index.dst),
        ),
        (
            r"self_attn\.compressor\.indexer\.q_b_proj\.weight",
            lambda: scatter_axis(t, 0, head_rows(index, n_iheads), n_iheads * index.dst),
        ),
        (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight", lambda: t * gi),
        (r"self_attn\.compressor\.kv_proj\.weight", lambda: _pad_blocks(t * ga, 0, attn)),
        (r"self_attn\.compressor\.gate_proj\.weight", lambda: _pad_blocks(t, 0, attn)),
        (r"self_attn\.compressor\.position_bias", lambda: _pad_blocks(t, 1, attn)),
        (r"self_attn\.compressor\.kv_norm\.weight", lambda: scatter_axis(t / ga, 0, channel_map(attn), attn.dst)),
        (r"self_attn\.q_b_proj\.weight", lambda: scatter_axis(t * ga, 0, head_rows(attn, n_heads), n_heads * attn.dst)),
        (r"self_attn\.kv_proj\.weight", lambda: scatter_axis(t * ga, 0, channel_map(attn), attn.dst)),
        (r"self_attn\.kv_norm\.weight", lambda: scatter_axis(t / ga, 0, channel_map(attn), attn.dst)),
        (
            r"self_attn\.o_a_proj\.weight",
            lambda: scatter_axis(t, 1, head_rows(attn, n_heads // groups), n_heads // groups * attn.dst),
        ),
    )
    for pattern, make in rules:
        if re.fullmatch(pattern, name):
            return make()
    return t


def _pad_blocks(t: torch.Tensor, dim: int, attn: HeadPad) -> torch.Tensor:
    """A compressor's kv/gate axis: one head (c128) or the two series Ca | Cb (c4), by the axis' width."""
    blocks = t.shape[dim] // attn.src
    return scatter_axis(t, dim, head_rows(attn, 1, blocks), blocks * attn.dst)


def pad_model(src: torch.nn.Module, config, index_topk: int) -> tuple[torch.nn.Module, dict]:
    """(padded `DeepseekV4ForCausalLM` in eval mode, its official-style config dict) from the transformers model
    `src` and its config; `index_topk` is the padded config's (the source's keeps its function exactly, a
    larger one attends more compressed entries). Weights keep their dtype; `src` is not changed."""
    from transformers import DeepseekV4ForCausalLM

    from flashmemory.hf.models import make_config

    raw = padded_config(config, index_topk)
    dst_cfg = make_config(copy.deepcopy(raw), "padded model")
    attn, index = head_pads(config)
    with torch.random.fork_rng(devices=[]):
        dst = DeepseekV4ForCausalLM(dst_cfg)
    want = dst.state_dict()
    state = {}
    for name, t in src.state_dict().items():
        m = re.fullmatch(r"model\.layers\.\d+\.(.+)", name)
        value = (
            _pad_param(
                m.group(1),
                t,
                attn,
                index,
                int(config.num_attention_heads),
                int(config.index_n_heads),
                int(config.o_groups),
            )
            if m
            else t
        )
        if name not in want or tuple(want[name].shape) != tuple(value.shape):
            got = tuple(want[name].shape) if name in want else "absent"
            raise ValueError(f"padding {name}: made {tuple(value.shape)}, the padded model has {got}")
        state[name] = value
    missing = sorted(set(want) - set(state))
    if missing:
        raise ValueError(f"padded model parameters without a source: {missing[:5]}")
    dst.load_state_dict(state, strict=True)
    return dst.to(next(src.parameters()).dtype).eval(), raw


def pad_retriever(retriever, config):
    """A `JointRetriever` over the padded model's index keys: each q head padded as the indexer's (pair p at 2p,
    zero elsewhere), weights_proj x sqrt(index_to / index) for its 1/sqrt(head) scale, the YaRN betas of the
    padded model. Hidden and rank are unchanged (the hidden states are the same)."""
    from dataclasses import replace

    from flashmemory.retriever.model import JointRetriever

    _, index = head_pads(config)
    d = retriever.dims
    if d.head_dim != index.src or d.rope_dim != index.rope:
        raise ValueError(
            f"retriever heads {d.head_dim} (rope {d.rope_dim}) do not read this model's index keys "
            f"{index.src} (rope {index.rope})"
        )
    bf, bs = padded_betas(config)
    rope = replace(retriever.rope, rope_dim=index.rope_to, beta_fast=bf, beta_slow=bs)
    dims = replace(d, head_dim=index.dst, rope_dim=index.rope_to)
    out = JointRetriever(retriever.layers, dims, rope)
    rows = head_rows(index, d.n_heads)
    with torch.no_grad():
        for lid in retriever.layers:
            a, b = retriever.layer(lid), out.layer(lid)
            b.logit_offset = a.logit_offset
            b.wq_a.weight.copy_(a.wq_a.weight)
            b.q_norm_weight.copy_(a.q_norm_weight)
            b.wq_b.weight.copy_(scatter_axis(a.wq_b.weight.detach(), 0, rows, d.n_heads * index.dst))
            b.weights_proj.weight.copy_(a.weights_proj.weight / index.norm_scale())
    return out.eval()
