"""Replay one document's decode through the real offload engine and Level 1, on any device.

The Full run's capture supplies what serving would produce step by step: the target-layer hidden
states, the index keys of every c4 layer (stored as sglang stores them) and the chunk schedule
(query at position P + t sees chunks j < (P + t + 1) // 4). Per decode step t:
  1. Level 1 `on_step` with the hidden state of position P + t - 1 (the latest finished forward); a
     due cycle (t % tau == 0) runs synchronously, so its set serves steps [t, t + tau);
  2. a chunk completed by token P + t is appended to the row's decode region;
  3. the resident set of step t is read back from the engine's lookup table (the single source of truth).
The replay admits a row with nothing resident, and its step-0 cycle runs on the prompt's last position (the
prefill attended the full history densely): no decode step has attended a resident set yet, so the miss monitor
takes no reading there (its native scorer gets the first decode position and returns None before it). A cycle at
step t > 0 measures the native logits of position P + t - 1 against the set decode step t - 1 attended.
How a request starts (`first_plan`; `FIRST_PLANS`): "prompt" (the default, what the published frontier models) runs
the step-0 cycle on the prompt's last position, as above. The live server cannot: its first cycle needs the hidden
state of the request's first decode forward (position P), so "full" and "recency" call Level 1 from step 1 on
(position P first), and until that plan is seen (`first_plan_lag` steps after step 1) the request attends every
visible chunk ("full": copy mode, sglang's pool holds every page) or its warm start, the newest kmax pages, and
the chunks decoded since ("recency": shrink mode).
Payload bytes: index-K rows are the real fp8 chunks; c4 KV rows are a deterministic pattern at the real
584-byte DeepSeek-V4 entry size (the tiny model's KV is not in sglang's layout), so byte counts are real.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashmemory.offload.engine import EngineConfig, OffloadEngine
from flashmemory.offload.layout import OffloadLayout
from flashmemory.residency.level1 import Level1, Level1Config, Scorer
from flashmemory.residency.policy import PagePolicy

# (engine, first decode position P) -> a `flashmemory.residency.monitored.MissMonitor` over it (None: no monitor);
# its native scorer must return None for a query position < P (no resident set attended yet: no reading)
MonitorFactory = Callable[[OffloadEngine, int], object]

KV_WIDTHS = (576, 8)  # DeepSeek-V4 c4 entry: 448 fp8 nope + 128 bf16 rope | 7 scales + 1 pad
KV_ALIGN = 576
FIRST_PLANS = ("prompt", "full", "recency")  # how a request is attended before its first Level-1 plan (module doc)


@dataclass
class ReplayResult:
    resident: torch.Tensor  # [T, N_c] bool: chunk j resident at decode step t (False past n_t)
    n_visible: torch.Tensor  # [T] int64: chunks visible at step t
    level1_s: float  # wall time spent in Level-1 calls (cycles included)
    metrics: dict  # engine.metrics()["total"] at the end of the replay, plus the monitor's readings:
    # "miss_values" (floats, cycle order) and "miss_steps" (the decode step t of each:
    # measured on position P + t - 1 against resident[t - 1])
    layout: OffloadLayout


def kv_pattern(n_layers: int, n_chunks: int, width: int = sum(KV_WIDTHS)) -> torch.Tensor:
    """uint8 [L, N, width] stand-in c4 KV rows, distinct per (layer, chunk) so misplaced bytes would show."""
    l = torch.arange(n_layers).view(-1, 1, 1)
    j = torch.arange(n_chunks).view(1, -1, 1)
    b = torch.arange(width).view(1, 1, -1)
    return ((l * 131 + j * 7 + b) % 251).to(torch.uint8)


def replay_doc(
    index_chunks: torch.Tensor,
    hidden: dict[int, torch.Tensor],
    prompt_len: int,
    n_steps: int,
    method: Callable[[OffloadEngine], tuple[Scorer, PagePolicy]],
    *,
    page_chunks: int,
    kmax: int,
    tau: int,
    last_keep: int,
    target_layers: tuple[int, ...],
    ratio: int = 4,
    device: str | torch.device = "cpu",
    monitor: MonitorFactory | None = None,
    page_cap: int | None = None,
    first_plan: str = "prompt",
    first_plan_lag: int = 0,
) -> ReplayResult:
    """Replay `n_steps` decode steps of one document.

    index_chunks: uint8 [n_c4, N_c, D+4] stored index keys of every c4 layer over prompt + response.
    hidden: target layer -> [S, hidden] indexer-input hidden of every position (S = P + n_steps).
    method: engine -> (scorer, policy) (see `flashmemory.eval.methods`); called once the engine exists
    because the retriever scorer reads the engine's target keys.
    monitor: (engine, prompt_len) -> MissMonitor (escalation; `kmax` is then its base budget); page_cap: the
    engine's per-request page cap (escalation's cap; default kmax).
    first_plan: one of FIRST_PLANS; first_plan_lag: decode steps between the first cycle (step 1) and the step
    whose attention sees its plan (live: the worker's publish), for "full" and "recency".
    """
    if first_plan not in FIRST_PLANS or first_plan_lag < 0:
        raise ValueError(f"first_plan {first_plan!r} / lag {first_plan_lag}: one of {FIRST_PLANS}, lag >= 0")
    n_layers, n_total, cb = index_chunks.shape
    layout = OffloadLayout(
        n_layers=n_layers,
        page_chunks=page_chunks,
        kv_widths=KV_WIDTHS,
        kv_align=KV_ALIGN,
        index_head_dim=cb - 4,
        target_layers=tuple(target_layers),
        index_offload=True,
    )
    n_pages = -(-n_total // page_chunks)
    decode_pages = -(-n_steps // (ratio * page_chunks)) + 2
    cap = max(kmax, page_cap or kmax)
    cfg = EngineConfig(
        max_rows=1,
        max_chunks=n_total,
        mirror_pages=n_pages + 1,
        recall_blocks=cap + 1,
        decode_pages=decode_pages,
        max_resident_pages=cap,
        pin_memory=False,
    )
    engine = OffloadEngine(layout, cfg, device)
    scorer, policy = method(engine)
    kv = kv_pattern(n_layers, n_total)
    level1 = Level1(
        engine,
        scorer,
        policy,
        Level1Config(tau=tau, max_resident_pages=kmax, last_keep=last_keep, async_recall=False),
        monitor=monitor(engine, prompt_len) if monitor is not None else None,
    )
    n0 = prompt_len // ratio
    engine.admit(0, kv[:, :n0], index_chunks[:, :n0], rid="doc")
    late = first_plan != "prompt"  # Level 1 from step 1 on; steps before 1 + first_plan_lag are attended apart
    warm = torch.zeros(n_total, dtype=torch.bool)  # the live warm start: the prompt's newest kmax pages
    warm[max(0, -(-n0 // page_chunks) - kmax) * page_chunks : n0] = True
    resident = torch.zeros(n_steps, n_total, dtype=torch.bool)
    n_vis = torch.zeros(n_steps, dtype=torch.int64)
    rows = torch.tensor([0])
    spent = 0.0
    values: list[float] = []
    steps: list[int] = []
    try:
        for t in range(n_steps):
            pos = prompt_len + t - 1
            n_read = engine.stats.miss_n
            t0 = time.perf_counter()
            if not late or t >= 1:
                level1.on_step([0], {lid: hidden[lid][pos : pos + 1] for lid in target_layers}, torch.tensor([pos]))
            spent += time.perf_counter() - t0
            if engine.stats.miss_n > n_read:  # one row: at most one reading per step
                values.append(engine.stats.miss_recent[-1])
                steps.append(t)
            n_t = min((prompt_len + t + 1) // ratio, n_total)
            while engine.n_chunks(0) < n_t:
                j = engine.n_chunks(0)
                engine.decode_append(rows, kv[:, j : j + 1], index_chunks[:, j : j + 1])
            cells = engine.cells(rows, torch.arange(n_t).view(1, -1))[0]
            resident[t, :n_t] = (cells >= 0).cpu()
            if late and t < 1 + first_plan_lag:  # the first plan is not seen yet
                if first_plan == "full":
                    resident[t, :n_t] = True
                else:  # the warm start and every chunk decoded since (the decode region)
                    resident[t, :n_t] = warm[:n_t] | (torch.arange(n_t) >= n0)
            n_vis[t] = n_t
        metrics = engine.metrics()["total"]
        metrics["miss_values"], metrics["miss_steps"] = values, steps  # the monitor's readings, in cycle order
    finally:
        level1.close()
        engine.finish(0)
    return ReplayResult(resident, n_vis, spent, metrics, layout)
