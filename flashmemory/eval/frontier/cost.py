"""Costs of each residency method on the frontier, in units that carry to a GPU, and their DeepSeek-V4-Flash
projection.

Measured on the replayed document (tiny model geometry: n_c4 c4 layers, N chunks at the end of the decode, T
decode steps, c4 entry 584 B as DeepSeek-V4 stores it, index key D + 4 B as the replay stores it):
  device_bytes     per request, split in "c4 kv" (Full: every chunk; FlashMemory-type methods: the KMAX-page
                   reserve, or the cap when the monitor may escalate; HiSparse: its hot buffer of H + 1 slots per
                   c4 layer, slot H holding the newest entry) and "index keys" (every layer's whole history on the
                   device for Full and HiSparse; for FlashMemory the retriever layers in full plus the resident
                   chunks of the others, the Path-I layout of the replay)
  h2d_per_token    host -> device bytes per decode step: FlashMemory's Level-1 recall bytes (engine metrics) / T;
                   HiSparse's synchronous swap-in misses x 584 B / T (from the LRU replay; with the prefetch arm
                   plus its prefetched entries, which move off the critical path); 0 for Full
  scored_per_token indexer entries scored per step: every visible chunk at every c4 layer (Full, HiSparse), or
                   the resident chunks at every c4 layer plus Level 1's full history at the retriever layers / tau
  l1_flops_per_token Level-1 FLOPs per step (`costmodel.flops.level1_terms` on the tiny shapes); 0 off FlashMemory
Projection (`project`): a budget b (share of history) held at DeepSeek-V4-Flash 128K / 256K / 1M on 8xH20: KMAX =
ceil(b x ctx/4 / 64) pages for FlashMemory (`costmodel.anchors.capacity` / `tok_s`, Path-I at 1M), a HiSparse hot
buffer of the same KMAX x 64 slots (at least the top-512) at the replayed hit rate, and stock; max concurrency
(what binds) and tok/s there. Nothing in the projection is measured on a GPU.
"""

from __future__ import annotations

import math

from flashmemory.costmodel.bytes import EntryBytes
from flashmemory.costmodel.flops import CountRules, FlashShape, RetrieverShape, level1_terms

KV_BYTES = EntryBytes().kv  # 584 B per c4 entry
PROJECT_CONTEXTS = (131072, 262144, 1048576)
LEVEL1_METHODS = ("FlashMemory", "FlashMemory+monitor", "FlashMemory-fill", "FlashMemory-threshold")
HISPARSE_ARMS = ("HiSparse", "HiSparse+prefetch")  # HiSparse alone and with FlashMemory's set as a prefetch hint
FULL_INDEX_METHODS = ("Full",) + HISPARSE_ARMS


def tiny_shapes(engine, retriever, tau: int, page_chunks: int) -> tuple[FlashShape, RetrieverShape]:
    """The cost model's shapes for the tiny model (only the fields Level 1's FLOPs read matter)."""
    cfg = engine.config
    kinds = list(getattr(cfg, "layer_types", []) or [])
    s = FlashShape(
        hidden=engine.hidden_size,
        n_layers=int(cfg.num_hidden_layers),
        n_heads=int(cfg.num_attention_heads),
        head_dim=int(cfg.head_dim),
        q_lora=int(cfg.q_lora_rank),
        o_groups=int(cfg.o_groups),
        index_heads=engine.index_n_heads,
        index_dim=engine.index_head_dim,
        index_topk=engine.index_topk,
        n_c4=engine.n_c4_layers,
        n_c128=kinds.count("heavily_compressed_attention"),
    )
    d = retriever.dims
    r = RetrieverShape(
        n_layers=len(retriever.layers),
        n_heads=d.n_heads,
        head_dim=d.head_dim,
        rank=d.rank,
        interval=tau,
        page_chunks=page_chunks,
    )
    return s, r


def level1_flops(ctx_tokens: int, s: FlashShape, r: RetrieverShape) -> float:
    """Level-1 FLOPs per decode step at a history of ctx_tokens tokens (q-proj + scoring, over tau)."""
    rules = CountRules()
    return sum(t.flops(rules) for t in level1_terms(ctx_tokens, s, r, rules))


def full_index_costs(
    method: str,
    m: dict,
    *,
    n_c4: int,
    n_final: int,
    n_vis_mean: float,
    n_steps: int,
    index_bytes: int,
    hot_slots: int | None = None,
    swap_misses: float | None = None,
) -> dict:
    """The cost fields of Full or a HiSparse arm (`FULL_INDEX_METHODS`: every index key on the device, every visible
    chunk scored). A HiSparse arm's H2D is its own on-demand misses plus the entries it prefetched (m["prefetched"],
    0 without a hint), x 584 B over the decode steps; the record's stats are enough to recompute it
    (`eval.frontier.recost`)."""
    idx_full = n_c4 * n_final * index_bytes
    kv = n_c4 * n_final * KV_BYTES if method == "Full" else n_c4 * (hot_slots + 1) * KV_BYTES
    moved = (swap_misses or 0.0) + float(m.get("prefetched", 0.0))  # on-demand misses + prefetched entries
    h2d = 0.0 if method == "Full" else moved * KV_BYTES / max(n_steps, 1)
    return {
        "device_bytes": kv + idx_full,
        "device_parts": {"c4 kv": kv, "index keys": idx_full},
        "h2d_per_token": h2d,
        "scored_per_token": n_c4 * n_vis_mean,
        "l1_flops_per_token": 0.0,
    }


def method_costs(
    method: str,
    m: dict,
    *,
    n_c4: int,
    n_target: int,
    n_final: int,
    n_vis_mean: float,
    n_steps: int,
    index_bytes: int,
    page_chunks: int,
    tau: int,
    l1_flops: float,
    hot_slots: int | None = None,
    swap_misses: float | None = None,
) -> dict:
    """The cost fields of one method's metrics `m` (from `eval.harness.evaluate_doc`) on one document.

    n_final: chunks visible after the last step (N); n_vis_mean: mean visible chunks per step; index_bytes: one
    stored index key (D + 4); hot_slots / swap_misses: HiSparse's H and the replayed misses of this row's own arm
    over all c4 layers."""
    if method in FULL_INDEX_METHODS:
        return full_index_costs(
            method,
            m,
            n_c4=n_c4,
            n_final=n_final,
            n_vis_mean=n_vis_mean,
            n_steps=n_steps,
            index_bytes=index_bytes,
            hot_slots=hot_slots,
            swap_misses=swap_misses,
        )
    pages = int(m.get("cap_pages") or m.get("kmax") or 0)
    reserve = min(pages * page_chunks, n_final)
    kv = n_c4 * reserve * KV_BYTES
    idx = n_target * n_final * index_bytes + (n_c4 - n_target) * reserve * index_bytes
    resident = float(m.get("resident_frac", 0.0)) * n_vis_mean
    l1 = method in LEVEL1_METHODS
    return {
        "device_bytes": kv + idx,
        "device_parts": {"c4 kv": kv, "index keys": idx},
        "h2d_per_token": float(m.get("recall_bytes", 0.0)) / max(n_steps, 1),
        "scored_per_token": n_c4 * resident + (n_target * n_vis_mean / tau if l1 else 0.0),
        "l1_flops_per_token": l1_flops if l1 else 0.0,
    }


def project(budget: float, hit_rate: float | None, contexts: tuple[int, ...] = PROJECT_CONTEXTS) -> list[dict]:
    """DeepSeek-V4-Flash on 8xH20 (calibrated preset) at a budget share: per context, FlashMemory, HiSparse (hot
    buffer of the same KMAX x 64 slots at `hit_rate`; skipped when None) and stock: device bytes and H2D bytes
    per request and step, indexer entries scored and Level-1 FLOPs per token, max concurrency (bound) and tok/s."""
    from flashmemory.costmodel.anchors import calibrated, calibrated_hisparse, capacity, fit, tok_s
    from flashmemory.costmodel.bytes import PolicyKnobs, baseline_bytes, flashmemory_bytes
    from flashmemory.costmodel.flops import flashmemory_flops, n_chunks, resident_chunks
    from flashmemory.costmodel.hisparse import hisparse_bytes
    from flashmemory.costmodel.presets import H20_NODE

    f = fit()
    p = calibrated(H20_NODE, f, fitted_memory=True)
    s = FlashShape()
    rows = []
    for ctx in contexts:
        kmax = max(1, math.ceil(budget * n_chunks(ctx) / RetrieverShape().page_chunks - 1e-9))
        hs = calibrated_hisparse(
            f,
            device_buffer_size=max(s.index_topk, kmax * RetrieverShape().page_chunks),
            hit_rate=hit_rate if hit_rate is not None else 0.0,
        )
        arms = {
            "Full": ("stock", baseline_bytes(ctx), n_chunks(ctx) * s.n_c4, 0.0),
            "FlashMemory": (
                "flashmemory",
                flashmemory_bytes(ctx, kmax, PolicyKnobs(path_i=ctx >= 1048576)),
                resident_chunks(kmax, ctx) * s.n_c4,
                flashmemory_flops(ctx, kmax).level1,
            ),
        }
        if hit_rate is not None:
            arms["HiSparse"] = ("hisparse", hisparse_bytes(ctx, hs), n_chunks(ctx) * s.n_c4, 0.0)
        for name, (arm, req, scored, l1) in arms.items():
            conc, bound = capacity(p, arm, ctx, kmax, hs)
            rows.append(
                {
                    "ctx": ctx,
                    "method": name,
                    "kmax": kmax,
                    "resident_per_topk": (min(kmax * 64, n_chunks(ctx)) / s.index_topk),
                    "device_bytes": req.device,
                    "h2d_per_token": req.pcie_step,
                    "scored_per_token": scored,
                    "l1_flops_per_token": l1,
                    "conc": conc,
                    "bound": bound,
                    "tok_s": tok_s(p, arm, ctx, conc, kmax, hs) if conc >= 1 else 0.0,
                }
            )
    return rows
