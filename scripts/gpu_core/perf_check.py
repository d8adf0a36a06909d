"""Checks (c) and (d): Level-1 scoring at serving batch, the per-step cost against the native indexer, and the
miss monitor's cost.

(c) Level 1 = the full-size retriever (3 target layers, `RetrieverLayer.query`: hidden 4096 -> 128 heads x 128)
    scoring each row's own history of N fp8 index-K chunks (uint8 [B, N, 132], dequantized block by block; the 3
    layers score the same key tensor with their own queries, which moves the same bytes as 3 tensors would).
    Against: an fp32 GEMM of the same FLOPs ([m, K] @ [K, K]; the ceiling, same dtype, TF32 left off as torch's
    default). Then one decode step at batch B: the native indexer (64 heads, same fp32 scorer on the same fp8 keys,
    plus its top-512) on 21 c4 layers (one timed, x21) against FlashMemory's per-step work: Level 1 amortized over
    tau plus score-resident Level 2 (`Level2.score_resident_topk` on an engine whose B requests each hold KMAX
    recalled pages and the newest page; its cost does not depend on N) on 21 layers (one timed, x21).
    Correctness: the timed Level-1 path equals `RetrieverLayer.logits` on the dequantized keys (fp32 tolerance),
    and every score is finite.
(d) The miss monitor: once per request per cycle, one native layer over the full history, `miss_mass` and
    `miss_report`; against the native indexer on 21 layers every step (batch 1). Correctness: the two functions
    agree on the miss mass and it lies in [0, 1].
"""

from __future__ import annotations

import torch

from gpu_core.core import (
    N_C4_LAYERS,
    TARGET_LAYERS,
    TOPK,
    CheckResult,
    EngineConfig,
    JointRetriever,
    Level2,
    OffloadEngine,
    OffloadLayout,
    RecallRequest,
    Sizes,
    chunks_to_pages,
    dequantize_chunks,
    gen,
    miss_mass,
    miss_report,
    random_fp8_keys,
    random_index_chunks,
    recall_sync,
    score_fp8,
    serving_retriever,
    time_fn,
)


def level1_flops(sz: Sizes, batch: int, n: int) -> float:
    """2 x multiply-adds of one Level-1 scoring of `batch` rows: per layer and row the query encoder (wq_a, wq_b,
    weights_proj) plus N x H x (2D for q.k + 2 for the relu-weighted sum)."""
    d = sz.dims
    query = 2 * (d.hidden * d.rank + d.rank * d.n_heads * d.head_dim + d.hidden * d.n_heads)
    return float(len(TARGET_LAYERS) * batch * (query + n * d.n_heads * (2 * d.head_dim + 2)))


def _level2_engine(sz: Sizes, batch: int, device: torch.device) -> tuple[Level2, torch.Tensor, int]:
    """`batch` requests, each with KMAX recalled pages plus its newest page resident. Returns (Level2, rows [B],
    the Path-I layer to score)."""
    d, k, pc = sz.dims.head_dim, sz.kmax, 64
    lay = OffloadLayout(n_layers=2, page_chunks=pc, kv_widths=(8,), kv_align=1, index_head_dim=d, target_layers=(0,))
    per = k + 1
    eng = OffloadEngine(
        lay,
        EngineConfig(
            max_rows=batch,
            max_chunks=per * pc,
            mirror_pages=batch * per,
            recall_blocks=batch * k,
            decode_pages=1,
            max_resident_pages=k,
        ),
        device,
    )
    pages = chunks_to_pages(random_index_chunks(16 * pc, d, gen(3)), pc)  # 16 distinct valid pages
    fill = pages.repeat(-(-eng.mirror.n_pages // pages.shape[0]), 1)[: eng.mirror.n_pages]
    eng.mirror.index[0].copy_(fill)
    eng.target.pages[0].copy_(fill.to(device))
    reqs = []
    for r in range(batch):
        g_ = eng.admit(r, None, None, mpages=list(range(r * per, (r + 1) * per)), n_chunks=per * pc)
        eng.open_tail_page(r)
        reqs.append(RecallRequest(r, g_, tuple(range(k)), tuple(1.0 for _ in range(k))))
    recall_sync(eng, reqs)
    if int(eng.res_count.min()) != per:
        raise RuntimeError(f"Level-2 cost engine: {int(eng.res_count.min())} resident pages, expected {per}")
    return Level2(eng, max_batch=batch, topk=TOPK), torch.arange(batch, device=device), lay.offload_index_layers[0]


def _level1_and_native_s(
    res: CheckResult,
    sz: Sizes,
    model: JointRetriever,
    b: int,
    n: int,
    g: torch.Generator,
    device: torch.device,
    first: bool,
) -> tuple[float, float]:
    """Median seconds of Level 1 (every target layer) and of one native indexer layer, both over B rows of N fp8
    keys (uint8 [B, N, 132]); the keys, the largest tensor of a case, are freed on return."""
    d, reps = sz.dims, sz.repeats
    keys = random_fp8_keys(b, n, d.head_dim, device, seed=b * 7919 + n)
    x = {lid: torch.randn(b, d.hidden, device=device, generator=g) for lid in model.layers}
    pos = torch.full((b,), 4 * n, device=device)

    def level1() -> list[torch.Tensor]:
        out = []
        for lid in model.layers:
            q, w = model.layer(lid).query(x[lid], pos)
            out.append(score_fp8(q, w, keys))
        return out

    qn = torch.randn(b, sz.native_heads, d.head_dim, device=device, generator=g)
    wn = torch.randn(b, sz.native_heads, device=device, generator=g)

    def native() -> torch.Tensor:
        return score_fp8(qn, wn, keys).topk(min(TOPK, n), dim=1).indices

    if first:  # the timed path computes the retriever's real logits
        n0 = min(n, 4096)
        lid = model.layers[0]
        want = model.layer(lid).logits(x[lid][:1], pos[:1], dequantize_chunks(keys[0, :n0]))
        q, w = model.layer(lid).query(x[lid][:1], pos[:1])
        got = score_fp8(q, w, keys[:1, :n0])
        err = float((got - want).abs().max())
        res.figures["level1_vs_reference_max_abs_err"] = err
        res.expect(
            err <= 1e-4 * float(want.abs().max()) + 1e-6,
            f"Level-1 timed path differs from RetrieverLayer.logits by {err:.3g}",
        )
    res.expect(all(bool(torch.isfinite(s).all()) for s in level1()), f"B={b} N={n}: non-finite Level-1 scores")
    return time_fn(level1, device, reps), time_fn(native, device, reps)


def _gemm_s(m: int, kk: int, g: torch.Generator, device: torch.device, reps: int) -> float:
    """Median seconds of an fp32 [m, kk] @ [kk, kk] product (the ceiling); its operands are freed on return."""
    a = torch.randn(m, kk, device=device, generator=g)
    bm = torch.randn(kk, kk, device=device, generator=g)
    return time_fn(lambda: a @ bm, device, reps)


def _scorer_case(
    res: CheckResult, sz: Sizes, model: JointRetriever, b: int, n: int, l2_s: float, device: torch.device, first: bool
) -> dict:
    g = torch.Generator(device=device).manual_seed(n + b)
    with torch.no_grad():
        t_l1, t_nat = _level1_and_native_s(res, sz, model, b, n, g, device, first)
        flops = level1_flops(sz, b, n)
        kk = 4096 if not sz.quick else 128
        m = max(1, round(flops / (2 * kk * kk)))
        t_mm = _gemm_s(m, kk, g, device, sz.repeats)
    l1_tf, mm_tf = flops / t_l1 / 1e12, 2.0 * m * kk * kk / t_mm / 1e12
    native_step = N_C4_LAYERS * t_nat
    fm_step = t_l1 / sz.tau + N_C4_LAYERS * l2_s
    return dict(
        batch=b,
        chunks=n,
        tokens=4 * n,
        level1_s=t_l1,
        level1_TFLOPs=l1_tf,
        gemm_s=t_mm,
        gemm_TFLOPs=mm_tf,
        level1_vs_gemm=l1_tf / mm_tf,
        native_1layer_s=t_nat,
        native_step_s=native_step,
        level2_1layer_s=l2_s,
        flashmemory_step_s=fm_step,
        flashmemory_vs_native=fm_step / native_step,
    )


def _level2_s(res: CheckResult, sz: Sizes, b: int, device: torch.device) -> float:
    """Median seconds of score-resident Level 2 on one layer at batch B; the engine is freed on return."""
    l2, l2_rows, layer = _level2_engine(sz, b, device)
    g = torch.Generator(device=device).manual_seed(b)
    q = torch.randn(b, sz.native_heads, sz.dims.head_dim, device=device, generator=g)
    w = torch.randn(b, sz.native_heads, device=device, generator=g)
    with torch.no_grad():
        out = l2.score_resident_topk(q, w, l2_rows, layer)
        picks = min(TOPK, l2.engine.res_cap * 64)
        res.expect(
            bool((out.cells[:, :picks] >= 0).all()),
            f"B={b}: score-resident Level 2 left picks empty with {l2.engine.res_cap} pages resident",
        )
        return time_fn(lambda: l2.score_resident_topk(q, w, l2_rows, layer), device, sz.repeats)


def run_scorer(sz: Sizes, device: torch.device, seed: int) -> CheckResult:
    res = CheckResult("c", "Level-1 scorer vs GEMM ceiling; native indexer x21 vs Level 1/tau + Level 2 x21")
    model = serving_retriever(res, sz.dims, device, seed)  # loaded on the CPU and placed as the server does
    rows, first = [], True
    for b in sz.batches:
        l2_s = _level2_s(res, sz, b, device)
        for n in sz.chunks:
            rows.append(_scorer_case(res, sz, model, b, n, l2_s, device, first))
            first = False
            if device.type == "cuda":
                torch.cuda.empty_cache()
    res.figures["rows"] = rows
    res.figures.update(
        tau=sz.tau,
        kmax_pages=sz.kmax,
        goals="level1_vs_gemm >= 0.6 at batch 64-128; flashmemory_vs_native <= 0.12 at 1M tokens",
    )
    big = [r for r in rows if r["batch"] >= 64]
    top = max(rows, key=lambda r: (r["chunks"], r["batch"]))
    res.summary = (
        "L1/GEMM "
        + ", ".join(f"B{r['batch']}@{r['tokens'] // 1024}K {r['level1_vs_gemm']:.2f}" for r in (big or rows))
        + " (goal >= 0.6 at B 64-128); "
        f"FM/native at B{top['batch']} {top['tokens'] // 1024}K tokens {top['flashmemory_vs_native']:.3f} "
        "(goal <= 0.12 at 1M)"
    )
    if sz.quick:
        res.summary += " [cpu quick: figures are not measurements]"
    return res


def _monitor_row(res: CheckResult, sz: Sizes, n: int, seed: int, device: torch.device) -> dict:
    """One history length N at batch 1: the monitor's cycle against one native layer; the keys are freed on
    return, before the next length is allocated."""
    d = sz.dims.head_dim
    keys = random_fp8_keys(1, n, d, device, seed=seed + n)
    g = torch.Generator(device=device).manual_seed(seed + n)
    q = torch.randn(1, sz.native_heads, d, device=device, generator=g)
    w = torch.randn(1, sz.native_heads, device=device, generator=g)
    resident = torch.rand(1, n, device=device, generator=g) < 0.1

    def monitor():
        logits = score_fp8(q, w, keys)
        return miss_mass(logits, resident, TOPK), miss_report(logits[0], resident[0], TOPK, 64, layer=10)

    with torch.no_grad():
        mm, rep = monitor()
        mm = float(mm[0])
        res.expect(
            0.0 <= mm <= 1.0
            and abs(mm - rep.miss_mass) <= 1e-5
            and abs(float(rep.missing_mass.sum()) - rep.miss_mass) <= 1e-4,
            f"N={n}: miss_mass {mm} and miss_report {rep.miss_mass} (pages sum "
            f"{float(rep.missing_mass.sum())}) disagree",
        )
        t_mon = time_fn(monitor, device, sz.repeats)
        t_nat = time_fn(lambda: score_fp8(q, w, keys).topk(min(TOPK, n), dim=1), device, sz.repeats)
    per_step = t_mon / sz.tau
    return dict(
        chunks=n,
        tokens=4 * n,
        monitor_cycle_s=t_mon,
        native_1layer_s=t_nat,
        native_step_s=N_C4_LAYERS * t_nat,
        monitor_per_step_s=per_step,
        monitor_vs_native=per_step / (N_C4_LAYERS * t_nat),
        miss_mass=mm,
    )


def run_monitor(sz: Sizes, device: torch.device, seed: int) -> CheckResult:
    res = CheckResult("d", "miss monitor per cycle vs native indexer x21 per step")
    rows = [_monitor_row(res, sz, n, seed, device) for n in sz.chunks]
    res.figures.update(rows=rows, tau=sz.tau, batch=1)
    res.summary = "monitor/native per step " + ", ".join(
        f"{r['tokens'] // 1024}K {r['monitor_vs_native']:.4f}" for r in rows
    )
    res.summary += f" (ideal 1/(21 x {sz.tau}) = {1 / (N_C4_LAYERS * sz.tau):.4f})"
    if sz.quick:
        res.summary += " [cpu quick: figures are not measurements]"
    return res
