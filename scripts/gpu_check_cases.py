"""What each case of `scripts/gpu_check.py` runs and how it passes: the case names, the tiny DeepSeek-V4 config,
each case's environment and engine arguments, the random retriever checkpoint of the retriever cases, and the
verdict on a finished case (`check_case`). Nothing here starts an engine; gpu_check.py runs the cases.
"""

from __future__ import annotations

CASES = ("stock", "full", "r10", "ret10", "off")  # "off" last: least informative if time runs out
PD_CASES = ("dstock", "dshrink")  # optional: GPU_CHECK_CASES=dstock,dshrink
TP_CASES = ("tp2stock", "tp2full", "tp2ret10")  # optional, two GPUs: GPU_CHECK_CASES=tp2stock,tp2full,tp2ret10
RANK_AGREE = ("level1_cycles", "recall_pages", "recall_bytes", "resident_fraction")  # equal on every TP rank
PROMPT_LEN, DECODE_STEPS, BATCHES, TOKEN_CHECK = 4096, 500, (1, 8, 64), 32
RET_LAYERS = (1,)  # the retriever's c4 layer (SGLANG_RETRIEVER_INLINE_LAYERS)


def tiny_config() -> dict:
    """A 6-layer DeepSeek-V4 with the V4-Flash per-layer shapes (sglang's DeepSeekV4Config defaults: hidden 4096,
    64 heads, q/o LoRA 1024, 8 output groups, 64 index heads) so the fused kernels see the head counts and widths
    they are built for; only depth, vocabulary and experts are cut (16 experts, top 6; ~5 GB of dummy bf16 weights).
    MQA head_dim 512 = 448 nope + 64 rope and one KV head (MQALayer asserts), index head 128, index_topk 512 (the
    backend asserts 512 or 1024), 2 c4 and 2 c128 layers, no quantization_config (bf16 experts). Checked on CPU
    through ModelConfig and ServerArgs.resolve_once (flashmemory/sglang/decode/README.md, "Verified against")."""
    ratios = [0, 4, 128, 4, 128, 0]
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 4096,
        "hidden_size": 4096,
        "intermediate_size": 2048,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": len(ratios),
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "hidden_act": "silu",
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "compress_ratios": ratios,
        "compress_rope_theta": 40000,
        "sliding_window": 128,
        "window_size": 128,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "num_nextn_predict_layers": 0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1,
            "mscale_all_dim": 1,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def case_env(case: str, stats_file: str = "", retriever: str = "") -> dict[str, str]:
    """The case's environment; retriever: the checkpoint `ret10` serves (`write_retriever`)."""
    pages = -(-PROMPT_LEN // 4 // 64) + DECODE_STEPS // 256 + 2
    env = {"SGLANG_PLUGINS": "flashmemory", "FLASHMEMORY_STATS_FILE": stats_file}
    if case in ("stock", "dstock", "tp2stock"):
        env["SGLANG_PLUGINS"] = "none"
    if case in ("full", "r10", "ret10", "dshrink", "tp2full", "tp2ret10"):
        env.update(
            {
                "SGLANG_DECODE_SWAP_P": "1",
                "SGLANG_PATHP_SCORE_RESIDENT": "1",
                "SGLANG_PATHP_CUDAGRAPH": "1",
                "SGLANG_RETRIEVER_INLINE_LAYERS": ",".join(map(str, RET_LAYERS)),
                "SGLANG_RETRIEVER_LAST_KEEP": "64",
                "SGLANG_PATHP_PAGE_KMAX": str(max(1, pages // 10) if case in ("r10", "ret10", "tp2ret10") else pages),
                "SGLANG_DSV4_TARGET_CONCURRENCY": "64",
            }
        )
    if case in ("ret10", "tp2full", "tp2ret10"):
        env["SGLANG_RETRIEVER_INLINE_CKPT"] = retriever or "<written by the run>"
    return env


def write_retriever(path: str, cfg: dict) -> str:
    """A random-weight retriever checkpoint for the tiny model (its hidden size and index head dim, c4 layer
    `RET_LAYERS`), which the plugin loads and checks at registration like a trained one."""
    import torch

    from flashmemory.retriever import save_retriever
    from flashmemory.retriever.model import JointRetriever, RetrieverDims

    torch.manual_seed(0)
    dims = RetrieverDims(hidden=cfg["hidden_size"], rank=256, n_heads=16, head_dim=cfg["index_head_dim"], rope_dim=64)
    return str(save_retriever(JointRetriever(RET_LAYERS, dims), path))


def engine_kwargs(model_dir: str, port: int, pd: bool = False, tp: int = 1) -> dict:
    """sgl.Engine / ServerArgs fields (names checked against sglang 0.5.23's ServerArgs.resolve_once on CPU);
    pd: a decode server with the `fake` transfer backend (the PD cases); tp: tensor parallelism (the TP cases)."""
    extra = dict(disaggregation_mode="decode", disaggregation_transfer_backend="fake") if pd else {}
    return dict(
        **extra,
        model_path=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        tp_size=tp,
        random_seed=0,
        port=port,
        mem_fraction_static=0.5,
        context_length=PROMPT_LEN + DECODE_STEPS + 64,
        max_total_tokens=max(BATCHES) * (PROMPT_LEN + DECODE_STEPS + 64) + 16384,
        max_running_requests=max(BATCHES),
        cuda_graph_max_bs_decode=max(BATCHES),
        cuda_graph_bs_decode=[1, 2, 8, 64],
        dsv4_attn_backend="flashmla",
        disable_radix_cache=True,
        log_level="info",
    )


REF_OF = {
    "dstock": "dstock",
    "dshrink": "dstock",
    "tp2stock": "tp2stock",
    "tp2full": "tp2stock",
    "tp2ret10": "tp2stock",
}  # the reference whose tokens each case is compared with; else stock


def check_case(c: str, r: dict, ref: list | None) -> list[str]:
    """Failures of one finished case."""
    bad = []
    if c in ("off", "full", "dshrink", "tp2full") and r["tokens"] != ref:
        why = "" if r.get("deterministic") and ref is not None else " (this engine is not run-to-run deterministic)"
        bad.append(f"{c}: greedy tokens differ from {REF_OF.get(c, 'stock')}{why}")
    if c == "off" and not r.get("plugin_state"):
        bad.append("off: the flashmemory plugin did not load (entry point missing?)")
    if c == "dshrink":
        d = r.get("diag") or {}
        if d.get("mode") != "shrink" or d.get("device_bytes_saved", 0) <= 0:
            bad.append(
                f"dshrink: Path-P did not run in shrink mode or saved no device memory ({d.get('mode')}, "
                f"{d.get('device_bytes_saved')} B); see the 'copy mode' warning in its log"
            )
    if c in TP_CASES[1:]:
        d, d1 = r.get("diag") or {}, r.get("diag_rank1") or {}
        if not d1:
            bad.append(f"{c}: no diagnostics from TP rank 1")
        differ = {k: (d.get(k), d1.get(k)) for k in RANK_AGREE if d.get(k) != d1.get(k)}
        if d1 and differ:
            bad.append(f"{c}: TP ranks 0 and 1 disagree (rank 0, rank 1): {differ}")
    if c in ("ret10", "tp2full", "tp2ret10"):
        d = r.get("diag") or {}
        if not str(d.get("retriever_device", "")).startswith("cuda"):
            bad.append(f"{c}: the retriever served from {d.get('retriever_device')!r}, not the GPU")
        if not d.get("level1_cycles"):
            bad.append(f"{c}: no Level-1 cycle completed (the retriever never scored)")
    if c in ("full", "r10", "ret10", "dshrink", "tp2full", "tp2ret10"):
        d = r.get("diag")
        if not d:
            bad.append(f"{c}: no diagnostics from the scheduler: FlashMemory did not run there")
        else:
            if not d.get("indexer_calls_captured") or not d.get("reserve_reads_captured"):
                bad.append(f"{c}: the hooks were not part of a CUDA-graph capture ({d})")
            if d.get("decode_forwards", 0) <= 0:
                bad.append(f"{c}: no decode forward reached the plugin")
            if d.get("sideband_stale"):
                bad.append(
                    f"{c}: {d['sideband_stale']} decode forwards left the Level-1 side band stale "
                    "(copy not in the graph)"
                )
    return bad
