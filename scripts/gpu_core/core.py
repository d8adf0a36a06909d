"""Shared pieces of `scripts/gpu_core_check.py`: the ONLY place the check imports the package from, the sizes,
the result record, timing and random fp8 data.

Imports are the package core's public entry points (offload, residency, retriever, atomic) and the serving
retriever's loader and placement (`flashmemory.sglang.decode.retriever_load`, which imports no sglang), nothing else:
no sglang, no transformers, no tqdm. Only long-stable torch APIs are used (torch >= 2.1: float8_e4m3fn,
torch.cuda.graph / CUDAGraph, streams and events, set_sync_debug_mode, pinned memory), because the lent H200
image has torch 2.11 while the project pins 2.14.1.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flashmemory.atomic import atomic_write_text  # noqa: F401  (re-exported for the entry script)
from flashmemory.env import FlashMemoryEnv
from flashmemory.offload import (  # noqa: F401
    EngineConfig,
    OffloadEngine,
    OffloadLayout,
    RecallPlan,
    RecallRequest,
    check_invariants,
    execute_recall,
    plan_recall,
    publish_recall,
)
from flashmemory.residency import Level2, miss_mass, miss_report  # noqa: F401
from flashmemory.retriever import (  # noqa: F401
    JointRetriever,
    RetrieverDims,
    chunks_to_pages,
    dequantize_chunks,
    quantize_chunks,
    relu_head_scores,
    save_retriever,
)
from flashmemory.sglang.decode.retriever_load import load_serving_retriever, place_retriever  # imports no sglang

N_C4_LAYERS = 21  # DeepSeek-V4-Flash c4 (CSA) layers: the native indexer runs on each, every step
TARGET_LAYERS = (10, 12, 20)
NATIVE_HEADS = 64  # the native lightning indexer: 64 heads x 128
TOPK = 512  # the native indexer's top-k


@dataclass(frozen=True)
class Sizes:
    """Every size the checks use. `full()` is the H200 run (<= 8 minutes), `quick()` the CPU smoke run."""

    quick: bool
    # (a) offload engine: churn trace at DeepSeek-V4 entry sizes (584-B c4 KV, 132-B index-K chunks)
    trace_layers: tuple[int, tuple[int, ...]]  # (c4 layers, target layers): (21, (10, 12, 20)) at full size
    trace_rows: int
    trace_max_chunks: int
    trace_ops: int
    trace_budget_s: float  # per layout: the trace stops early (and says so) to keep the run in its 8 minutes
    trace_recall_blocks: int
    trace_kmax: int
    recall_kmax: int  # pages per bandwidth measurement (KMAX)
    # (b) Level 2 in a CUDA graph
    l2_batches: tuple[int, ...]
    l2_max_chunks: int
    l2_kmax: int
    l2_steps: int
    l2_topk: int
    # (c) Level-1 scorer and the per-step comparison; (d) monitor
    batches: tuple[int, ...]
    chunks: tuple[int, ...]
    dims: RetrieverDims
    native_heads: int
    kmax: int  # resident pages per request for the score-resident Level-2 cost
    tau: int
    repeats: int

    @classmethod
    def full(cls) -> "Sizes":
        return cls(
            quick=False,
            trace_layers=(N_C4_LAYERS, TARGET_LAYERS),
            trace_rows=8,
            trace_max_chunks=1024,
            trace_ops=400,
            trace_budget_s=75.0,
            trace_recall_blocks=40,
            trace_kmax=8,
            recall_kmax=96,
            l2_batches=(1, 64, 128),
            l2_max_chunks=4096,
            l2_kmax=8,
            l2_steps=100,
            l2_topk=TOPK,
            batches=(1, 64, 128),
            chunks=(65536, 262144),
            dims=RetrieverDims(),
            native_heads=NATIVE_HEADS,
            kmax=96,
            tau=64,
            repeats=3,
        )

    @classmethod
    def tiny(cls) -> "Sizes":
        return cls(
            quick=True,
            trace_layers=(4, (1, 3)),
            trace_rows=4,
            trace_max_chunks=512,
            trace_ops=120,
            trace_budget_s=600.0,
            trace_recall_blocks=5,
            trace_kmax=3,
            recall_kmax=2,
            l2_batches=(1, 3, 4),
            l2_max_chunks=256,
            l2_kmax=2,
            l2_steps=12,
            l2_topk=32,
            batches=(1, 2),
            chunks=(256, 512),
            dims=RetrieverDims(hidden=32, rank=16, n_heads=4, head_dim=16, rope_dim=8),
            native_heads=4,
            kmax=2,
            tau=64,
            repeats=1,
        )


@dataclass
class CheckResult:
    """One check's outcome. ok: False when a correctness check failed; figures: every number measured (JSON-able);
    skipped: parts not run, with the reason; failures: one line per failed correctness check."""

    name: str
    title: str
    ok: bool = True
    summary: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def fail(self, msg: str) -> None:
        self.ok = False
        self.failures.append(msg)

    def expect(self, cond: bool, msg: str) -> bool:
        if not cond:
            self.fail(msg)
        return cond


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall seconds of `fn` over `repeats` runs after one warm-up, the device synchronized around each."""
    fn()
    sync(device)
    ts = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def gen(seed: int) -> torch.Generator:
    """A CPU generator: data made from it is the same on every device (the CPU-vs-CUDA engine check needs that)."""
    return torch.Generator().manual_seed(seed)


def random_index_chunks(n: int, head_dim: int, g: torch.Generator) -> torch.Tensor:
    """uint8 [n, head_dim + 4] valid fp8 index-K chunks (finite keys, positive scales), made on the CPU."""
    return quantize_chunks(torch.randn(n, head_dim, generator=g))


def random_engine_chunks(layout: OffloadLayout, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv uint8 [n_layers, n, kv_chunk_bytes] random bytes, index uint8 [n_layers, n, D+4] valid fp8 chunks)."""
    kv = torch.randint(0, 256, (layout.n_layers, n, layout.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = random_index_chunks(layout.n_layers * n, layout.index_head_dim, g).view(layout.n_layers, n, -1)
    return kv, ix


def random_fp8_keys(batch: int, n: int, head_dim: int, device: torch.device, seed: int) -> torch.Tensor:
    """uint8 [batch, n, head_dim + 4] fp8 index-K chunks made on `device` (GiB-sized at serving sizes): random
    e4m3fn bytes with the NaN codes (0x7f, 0xff) moved to the neighbouring finite value, and scales in [1e-3, 2e-3)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(batch, n, head_dim + 4, dtype=torch.uint8, device=device)
    for b in range(batch):
        vals = torch.randint(0, 256, (n, head_dim), dtype=torch.uint8, device=device, generator=g)
        out[b, :, :head_dim] = torch.where((vals & 0x7F) == 0x7F, vals - 1, vals)
        scale = torch.rand(n, 1, device=device, generator=g) * 1e-3 + 1e-3
        out[b, :, head_dim:] = scale.view(torch.uint8)
    return out


def score_fp8(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, block: int = 8192) -> torch.Tensor:
    """sum_h relu(q_h . k_n) w_h over fp8 chunks, dequantized block by block (the indexer's and Level 1's scoring).

    q: fp32 [B, H, D]; w: fp32 [B, H]; keys: uint8 [B, N, D+4] (one history per row). Returns fp32 [B, N]."""
    b, n = keys.shape[0], keys.shape[1]
    out = torch.empty(b, n, dtype=torch.float32, device=keys.device)
    for s in range(0, n, block):
        out[:, s : s + block] = relu_head_scores(q, w, dequantize_chunks(keys[:, s : s + block]))
    return out


def recall_sync(eng: OffloadEngine, reqs: Sequence[RecallRequest]) -> RecallPlan:
    """Plan, copy and publish one Level-1 recall synchronously (what the Level-1 worker does for a cycle)."""
    plan = plan_recall(eng, reqs)
    execute_recall(eng, plan)
    publish_recall(eng, plan)
    return plan


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def serving_retriever(res: CheckResult, dims: RetrieverDims, device: torch.device, seed: int) -> JointRetriever:
    """The retriever as the server gets it: random weights saved as a checkpoint, loaded on the CPU by the plugin's
    loader (`load_serving_retriever`), then moved by the serving placement (`place_retriever`). `res` fails when a
    parameter or buffer is not on `device` afterwards, or a weight changed on the way."""
    torch.manual_seed(seed)
    src = JointRetriever(TARGET_LAYERS, dims).eval()
    with tempfile.TemporaryDirectory() as d:
        path = save_retriever(src, os.path.join(d, "retriever.safetensors"))
        model = load_serving_retriever(FlashMemoryEnv(retriever_ckpt=str(path), retriever_layers=TARGET_LAYERS))
    res.expect(
        all(t.device.type == "cpu" for t in model.state_dict().values()),
        "the serving loader did not return the retriever on the CPU (registration precedes the device)",
    )
    model = place_retriever(model, device)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    off = [f"{n} on {t.device}" for n, t in tensors if t.device.type != device.type]
    res.expect(not off, f"serving placement left retriever tensors off {device.type}: {off[:4]}")
    want = src.state_dict()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v.cpu(), want[k])]
    res.expect(not changed, f"retriever weights changed between checkpoint and device: {changed[:4]}")
    res.figures["retriever_placed_on"] = str(tensors[0][1].device) if tensors else "none"
    return model
