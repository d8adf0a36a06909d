"""What every FlashMemory environment variable means: its default as a string and one line, in README order.

The values are parsed in `flashmemory.env` (with its `env_*` parts, the only modules that read the environment);
this table is what the gate table of `docs/configuration.md` prints (`flashmemory.sglang.plumbing.gates`).
`tests/test_env.py` checks that its defaults are `flashmemory.env`'s and that it names every variable
`flashmemory.env` reads.
"""

from __future__ import annotations

# name -> (default as a string, one-line meaning)
ENV_DOC: dict[str, tuple[str, str]] = {
    "SGLANG_DECODE_SWAP_P": (
        "0",
        "Path-P: c4 KV lives in a host mirror; resident pages are recalled into a device reserve",
    ),
    "SGLANG_PATHP_INDEX_K_OFFLOAD": ("0", "Path-I: index-K of the non-target c4 layers is offloaded the same way"),
    "SGLANG_PATHP_SCORE_RESIDENT": (
        "0",
        "Level 2 scores only the resident pages (otherwise: mask mode over the full history)",
    ),
    "SGLANG_PATHP_PAGE_RECALL": ("0", "Accepted for compatibility; recall is always page-granular here"),
    "SGLANG_PATHP_CUDAGRAPH": (
        "0",
        "Allocate Level-2 buffers before capture so Level 2 runs inside the decode CUDA graph",
    ),
    "SGLANG_PATHP_ASYNC_RECALL": (
        "1",
        "Run the Level-1 cycle on a worker thread (and a side CUDA stream when present)",
    ),
    "SGLANG_PATHP_FUSED_REMAP": ("0", "Score-resident top-k columns map straight to reserve cells"),
    "SGLANG_PATHP_STAGGER_CYCLE": ("0", "Give each request its own phase within the tau window"),
    "SGLANG_PATHP_PAGE_KMAX": ("96", "Resident pages (64 chunks each) per request"),
    "SGLANG_PATHP_PAGE_KMAX_RATIO": ("0", "If > 0: KMAX = ceil(ratio * pages of SGLANG_DSV4_TARGET_CONTEXT)"),
    "SGLANG_DSV4_TARGET_CONTEXT": ("262144", "Target context in tokens, for the KMAX ratio"),
    "SGLANG_DSV4_TARGET_CONCURRENCY": ("64", "Target concurrency, for auto reserve sizing"),
    "SGLANG_PATHP_RESERVE_PAGES": ("0", "Recall page blocks per layer; 0 = TARGET_CONCURRENCY * (KMAX + 1)"),
    "SGLANG_PATHP_DECODE_RESIDENT_CHUNKS": ("512", "Per-request decode region, in chunks (decode-time c4 entries)"),
    "SGLANG_PATHP_DECODE_MAX_CONC": ("128", "Number of decode regions (max concurrent requests)"),
    "SGLANG_PD_B_C4_SHRINK": (
        "1",
        "With Path-P on a PD decode server (nixl): PD lands c4 KV in the host mirror and "
        "the device c4 KV pool becomes the reserve (otherwise copy mode: no device memory "
        "saved)",
    ),
    "SGLANG_PD_CREDIT_OFFLOADED_C4": (
        "0",
        "With the shrink active: size sglang's token pool without the c4 KV bytes "
        "(more tokens; the reserve then comes out of the non-static headroom)",
    ),
    "SGLANG_RETRIEVER_INLINE_CKPT": ("", "Retriever checkpoint (.safetensors or .pt); empty = Level 1 off"),
    "SGLANG_RETRIEVER_INLINE_LAYERS": ("10,12,20", "Target layers, as ids among the 21 c4 layers"),
    "SGLANG_RETRIEVER_INTERVAL": ("64", "tau: decode steps between Level-1 cycles"),
    "SGLANG_RETRIEVER_SIGMOID_THRESH": ("0.5", "A chunk passes if its ensemble score is strictly above this"),
    "SGLANG_RETRIEVER_LAST_KEEP": ("2048", "Recency tail, in c4 chunks (4 tokens each)"),
    "SGLANG_RETRIEVER_FIRST_KEEP": ("0", "Sink, in c4 chunks"),
    "SGLANG_RETRIEVER_ENSEMBLE_MODE": ("or", "'or' = max over layers, 'mean' = average"),
    "SGLANG_RETRIEVER_PAGE_POLICY": (
        "fill",
        "Level-1 pages: 'fill' = pages with a chunk above the threshold, then the best-scoring other pages "
        "until KMAX; 'threshold' = only the former (plus tail and sink), fewer than KMAX when few chunks pass",
    ),
    "SGLANG_RETRIEVER_MAX_RESIDENT": ("0", "Cap on resident chunks per request; 0 = none"),
    "SGLANG_RETRIEVER_MAX_POSITION": (
        "1048576",
        "Retriever RoPE position clamp when serving, whatever the checkpoint stores; positions beyond it are clamped",
    ),
    "SGLANG_RETRIEVER_LOGIT_OFFSET": ("0.0", "Added to the retriever logit before the sigmoid"),
    "SGLANG_RETRIEVER_MISS_MONITOR": (
        "0",
        "Miss monitor: once per cycle and request, one rotated target layer's "
        "native indexer scores the full history; its top-k mass outside the resident "
        "set is the miss mass, which drives escalation and the fallback",
    ),
    "SGLANG_RETRIEVER_MISS_THRESHOLD": (
        "0.2",
        "Miss mass above this adds the missed pages and widens the request's page budget for the next cycles",
    ),
    "SGLANG_RETRIEVER_MISS_LOW": (
        "0.05",
        "Miss mass at or below this counts towards shrinking back and leaving the fallback",
    ),
    "SGLANG_RETRIEVER_MISS_KMAX_CAP": ("0", "Most resident pages an escalated request may hold; 0 = 2 x KMAX"),
    "SGLANG_RETRIEVER_MISS_EXTRA_PAGES": (
        "0",
        "Pages above KMAX lent to escalated requests, all requests together; "
        "0 = what the reserve holds beyond DECODE_MAX_CONC x (KMAX + 1)",
    ),
    "SGLANG_RETRIEVER_MISS_SHRINK_AFTER": ("2", "Low-miss cycles in a row before a request gives a budget step back"),
    "SGLANG_RETRIEVER_MISS_FALLBACK_AFTER": (
        "2",
        "High-miss cycles in a row before a request holds the latest native "
        "top-k pages beside the retriever's picks (exact-recall fallback)",
    ),
    "SGLANG_FLASHMEMORY_DUMP": ("0", "Dump mode for data generation (per request, via custom_params)"),
    "SGLANG_FLASHMEMORY_DUMP_ROOT": (
        "",
        "Dump mode: absolute directory; a request's output_dir must lie inside it "
        "(required with SGLANG_FLASHMEMORY_DUMP=1)",
    ),
    "SGLANG_PATHP_DISK_DIR": (
        "",
        "Disk tier under the host mirror (with SGLANG_DECODE_SWAP_P=1): absolute directory "
        "for each rank's c4 KV page store file; recalls read complete pages through a host page "
        "cache in front of it (the mirror shrinks only with SGLANG_PATHP_HOST_MIRROR_GB); "
        "empty = no disk tier",
    ),
    "SGLANG_PATHP_DISK_GB": ("64", "Disk tier: page store size per rank, in GB (1e9 B)"),
    "SGLANG_PATHP_HOST_CACHE_GB": (
        "8",
        "Disk tier: host-DRAM page cache in front of the store, per rank, in GB (1e9 B)",
    ),
    "SGLANG_PATHP_HOST_MIRROR_GB": (
        "",
        "Disk tier: the host mirror becomes a landing window of this many GB (1e9 B) "
        "per rank (at least DECODE_MAX_CONC x 3 pages): a sealed page leaves it once the "
        "tier holds it, so host DRAM = window + host cache; empty = full-size mirror. "
        "In shrink mode (PD lands KV in the mirror by pool page) it caps the landed pages of "
        "requests waiting to run instead: past it they wait in the tier and are read back before they run",
    ),
    "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": (
        "0",
        "HiSparse prefetch mode (PD decode server with --enable-hisparse, "
        "not with SGLANG_DECODE_SWAP_P): hinted c4 positions are copied into "
        "HiSparse's hot buffer after each layer's own swap-in; outputs stay "
        "exact. With SGLANG_RETRIEVER_INLINE_CKPT, Level 1 (Path-P off) is "
        "the hint source: each cycle's resident pages become the hint",
    ),
    "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_WIDTH": (
        "64",
        "Prefetch mode: hinted positions per request per decode step (capped at hot buffer - top-k)",
    ),
    "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH_BUDGET": (
        "0",
        "Prefetch mode: hinted positions per request per cycle; 0 = hot buffer - top-k (also the cap)",
    ),
    "SGLANG_FLASHMEMORY_CPU": (
        "0",
        "Run sglang's DeepSeek-V4 path on CPU: torch fallbacks for the CUDA-only kernels "
        "(with --device cpu; independent of the FlashMemory gates)",
    ),
    "SGLANG_FLASHMEMORY_CPU_SWA_WINDOW": (
        "0",
        "With SGLANG_FLASHMEMORY_CPU=1: the sliding window sglang's DeepSeek-V4 backend attends (its module constant "
        "SWA_WINDOW, 128), for a tiny model trained narrower (the padded trained model: 32); 0 = sglang's own",
    ),
}
