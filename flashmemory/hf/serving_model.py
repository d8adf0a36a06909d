"""A seeded tiny DeepSeek-V4 checkpoint that sglang 0.5.23 serves on CPU and transformers loads too.

Geometry: sglang's DSv4 pool asserts 584 B per c4 KV entry (448 fp8 nope + 64 bf16 rope + 8 scale bytes),
so `head_dim` is 512 with rope 64; its backend fixes page 256 and `index_topk` 512; index heads are 128 wide
(132-B index-K entries). Everything else is as small as that allows (hidden 256, 6 layers
[SWA, c4, c128, c4, c128, SWA], vocab 1024).

The directory holds:
- `config.json` in the official key style (`compress_ratios`, `rope_scaling`, `window_size`, `n_hash_layers`):
  sglang reads those keys; transformers maps them (`compress_ratios` -> `layer_types`, ...).
- `model.safetensors`, bf16 (int64 for the hash table `tid2eid`), under the official checkpoint names
  (`embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`, ...): sglang's loader
  and transformers' conversion mapping both start from these names.
- an offline byte-level `tokenizer.json` whose first 26 ids are the DeepSeek special tokens the DSv4 chat
  encoder looks up (`<｜begin▁of▁sentence｜>` = 0, `<｜end▁of▁sentence｜>` = 1, `<｜User｜>`, ...).
- `flashmemory_build.json`: seed and a SHA-256 per file, so a rebuild can prove it is the same model.
"""

from __future__ import annotations

import copy
import re

import torch

# Official-style config; keys both loaders read. `sliding_window` (sglang ModelConfig, transformers) and
# `window_size` (sglang's DeepSeekV4Config) carry the same number, as do `num_hash_layers` / `n_hash_layers`.
SERVING_TINY_CONFIG: dict = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 448,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "o_groups": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 1,
    "n_hash_layers": 1,
    "n_group": 1,
    "topk_group": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 512,
    "sliding_window": 128,
    "window_size": 128,
    "compress_ratios": [0, 4, 128, 4, 128, 0],
    "compress_rope_theta": 40000,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 65536,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    # Wider than transformers' 0.02 so greedy picks are decided by clear margins, not bf16 noise.
    "initializer_range": 0.1,
    "torch_dtype": "bfloat16",
}

# The DeepSeek special tokens, in id order (bos = 0, eos = 1 as in the config). `<｜deepseek_image｜>` is the
# checkpoint's image token (sglang's renderer); the six task tokens are looked up by `_attach_task`.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<think>",
    "</think>",
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "｜DSML｜",
    "<｜deepseek_image｜>",
    "<｜image｜>",
    "<｜ref｜>",
    "<｜/ref｜>",
    "<｜box｜>",
    "<｜/box｜>",
    "<｜point｜>",
    "<｜/point｜>",
    "<｜polygon｜>",
    "<｜/polygon｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
)


def serving_config() -> dict:
    """A fresh copy of the serving-tiny official-style config dict (callers may edit it)."""
    return copy.deepcopy(SERVING_TINY_CONFIG)


# transformers parameter name (after its conversion mapping) -> official checkpoint name, per layer.
# Order matters: the first matching pattern wins.
_LAYER_RENAMES: tuple[tuple[str, str], ...] = (
    (r"self_attn\.sinks$", "attn.attn_sink"),
    (r"self_attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
    (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
    (r"self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
    (r"self_attn\.", "attn."),
    (r"mlp\.shared_experts\.gate_proj\.", "ffn.shared_experts.w1."),
    (r"mlp\.shared_experts\.down_proj\.", "ffn.shared_experts.w2."),
    (r"mlp\.shared_experts\.up_proj\.", "ffn.shared_experts.w3."),
    (r"mlp\.gate\.e_score_correction_bias$", "ffn.gate.bias"),
    (r"mlp\.", "ffn."),
    (r"input_layernorm\.", "attn_norm."),
    (r"post_attention_layernorm\.", "ffn_norm."),
    (r"attn_hc\.(fn|base|scale)$", r"hc_attn_\1"),
    (r"ffn_hc\.(fn|base|scale)$", r"hc_ffn_\1"),
)
# Leaf renames inside attn / compressor (applied after the prefix rename above).
_LEAF_RENAMES: tuple[tuple[str, str], ...] = (
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"attn\.q_b_proj\.", "attn.wq_b."),
    (r"compressor\.kv_proj\.", "compressor.wkv."),
    (r"compressor\.gate_proj\.", "compressor.wgate."),
    (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"compressor\.position_bias$", "compressor.ape"),
    (r"attn\.kv_proj\.", "attn.wkv."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
)
_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def official_name(hf_name: str) -> str:
    """transformers `DeepseekV4ForCausalLM` parameter name -> official checkpoint name (not for fused experts)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m is None:
        raise ValueError(f"no official name for transformers parameter {hf_name!r}")
    rest = m.group(2)
    for pat, rep in _LAYER_RENAMES:
        if re.search(pat, rest):
            rest = re.sub(pat, rep, rest, count=1)
            break
    for pat, rep in _LEAF_RENAMES:
        rest = re.sub(pat, rep, rest)
    return f"layers.{m.group(1)}.{rest}"


def official_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under official names; fused experts are split per expert into w1/w3 (gate/up) and w2.

    gate_up_proj [E, 2I, H] -> experts.e.w1.weight [I, H] (rows :I) and w3 [I, H] (rows I:); down_proj
    [E, H, I] -> experts.e.w2.weight. Tensors are contiguous clones (safetensors refuses shared storage).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if m is None:
            out[official_name(name)] = t.detach().clone().contiguous()
            continue
        base = f"layers.{m.group(1)}.ffn.experts"
        for e in range(t.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{base}.{e}.w2.weight"] = t[e].clone().contiguous()
            else:
                inter = t.shape[1] // 2
                out[f"{base}.{e}.w1.weight"] = t[e, :inter].clone().contiguous()
                out[f"{base}.{e}.w3.weight"] = t[e, inter:].clone().contiguous()
    return out
