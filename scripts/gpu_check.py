"""One-H200 smoke check of the FlashMemory sglang plugin on a tiny dummy-weight DeepSeek-V4 (see gpu_check.sh).

Cases run as separate processes (the gates are read once per process by the plugin):
  stock      no FlashMemory entry point loaded (SGLANG_PLUGINS=none)      greedy tokens = reference
  off        plugin loaded, every gate off                                 tokens == stock
  full       gates on, KMAX covers the whole context (100% residency)      tokens == stock
  r10        gates on, KMAX = 10% of the context pages, 500 decode steps at batch 1, 8, 64
Prints a summary table: tokens/s of each case relative to `off`, recall bytes, resident fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CASES = ("stock", "off", "full", "r10")
PROMPT_LEN, DECODE_STEPS, BATCHES = 4096, 500, (1, 8, 64)


def tiny_config() -> dict:
    """Smallest config sglang's DSv4 code accepts (head_dim 512, index head 128, page 256); 2 c4 layers."""
    ratios = [0, 4, 128, 4, 128, 0]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 4096,
        "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256, "num_hidden_layers": len(ratios),
        "num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 256, "o_lora_rank": 256, "o_groups": 4, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "hidden_act": "silu", "index_n_heads": 16,
        "index_head_dim": 128, "index_topk": 512, "compress_ratios": ratios, "compress_rope_theta": 40000,
        "sliding_window": 128, "window_size": 128, "hc_mult": 4, "hc_sinkhorn_iters": 4, "hc_eps": 1e-6,
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_theta": 10000, "num_nextn_predict_layers": 0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


def case_env(case: str) -> dict[str, str]:
    pages = -(-PROMPT_LEN // 4 // 64) + DECODE_STEPS // 256 + 2
    env = {"SGLANG_PLUGINS": "flashmemory"}
    if case == "stock":
        env["SGLANG_PLUGINS"] = "none"
    if case in ("full", "r10"):
        env.update({"SGLANG_DECODE_SWAP_P": "1", "SGLANG_PATHP_SCORE_RESIDENT": "1", "SGLANG_PATHP_CUDAGRAPH": "1",
                    "SGLANG_RETRIEVER_INLINE_LAYERS": "1", "SGLANG_RETRIEVER_LAST_KEEP": "64",
                    "SGLANG_PATHP_PAGE_KMAX": str(pages if case == "full" else max(1, pages // 10)),
                    "SGLANG_DSV4_TARGET_CONCURRENCY": "64"})
    return env


def run_case(case: str, model_dir: str, out: str) -> None:
    import sglang as sgl
    from flashmemory.sglang.runtime import RUNTIME
    eng = sgl.Engine(model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, tp_size=1,
                     random_seed=0, mem_fraction_static=0.6, context_length=PROMPT_LEN + DECODE_STEPS + 64,
                     max_running_requests=64, disable_radix_cache=True, log_level="warning")
    res = {"case": case, "tokens": None, "tok_s": {}, "stats": {}}
    try:
        prompt = [[(7 * i + 3 * b) % 4000 + 10 for i in range(PROMPT_LEN)] for b in range(max(BATCHES))]
        sp = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
        res["tokens"] = [o["output_ids"] for o in eng.generate(input_ids=prompt[:2], sampling_params=sp)]
        for bs in BATCHES:
            sp = {"temperature": 0.0, "max_new_tokens": DECODE_STEPS, "ignore_eos": True}
            t = time.perf_counter()
            outs = eng.generate(input_ids=prompt[:bs], sampling_params=sp)
            dt = time.perf_counter() - t
            res["tok_s"][bs] = sum(len(o["output_ids"]) for o in outs) / dt
        info = eng.get_server_info() if hasattr(eng, "get_server_info") else {}
        res["cuda_graph"] = json.dumps(info, default=str).count("cuda_graph") > 0
        if RUNTIME.engine is not None:
            res["stats"] = RUNTIME.engine.stats()
    finally:
        eng.shutdown()
    with open(out, "w") as f:
        json.dump(res, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dry-run", action="store_true", help="print the plan, touch no GPU")
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--case-timeout", type=int, default=110)
    a = ap.parse_args()
    if a.case:
        run_case(a.case, a.model_dir, a.out)
        return 0
    if a.dry_run:
        for c in CASES:
            print(f"case {c}: env {case_env(c)}")
        print(f"config: {json.dumps(tiny_config())[:120]}...")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="fm_gpu_check_")
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(tiny_config(), f)
    results, failures = {}, []
    for c in CASES:
        out = os.path.join(work, f"{c}.json")
        env = {**os.environ, **case_env(c)}
        p = subprocess.run([sys.executable, __file__, "--case", c, "--model-dir", work, "--out", out], env=env,
                           timeout=a.case_timeout, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.exists(out):
            failures.append(f"{c}: exit {p.returncode}\n{p.stderr[-3000:]}")
            continue
        results[c] = json.load(open(out))
    ref = results.get("stock", {}).get("tokens")
    for c in ("off", "full"):
        if c in results and results[c]["tokens"] != ref:
            failures.append(f"{c}: greedy tokens differ from stock")
    base = results.get("off", {}).get("tok_s", {})
    print(f"{'case':6} " + " ".join(f"{'bs' + str(b) + ' x off':>12}" for b in BATCHES) + "  recall_bytes  resident")
    for c, r in results.items():
        rel = " ".join(f"{r['tok_s'].get(str(b), 0) / max(base.get(str(b), 1e-9), 1e-9):12.2f}" for b in BATCHES)
        st = r.get("stats", {})
        print(f"{c:6} {rel}  {st.get('recall_bytes', 0):12.0f}  {st.get('resident_fraction', float('nan')):.3f}")
    for msg in failures:
        print("FAIL", msg)
    print("gpu_check:", "FAILED" if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
