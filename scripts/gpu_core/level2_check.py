"""Check (b): Level 2 (mask and score-resident) captured once in a CUDA graph, replayed while residency changes.

For each batch size B: an engine with 128 rows (one c4 layout: a target layer and two Path-I layers, 128-dim fp8
index keys; the c4 KV is shrunk to 8 B a chunk because Level 2 never reads it) holds requests of random length.
Three `Level2` instances (mask; score-resident on the target layer, which reads the device index-K pool;
score-resident on a Path-I layer, which reads the index reserve) are captured in ONE graph over static inputs
(rows with a padding row, native logits [B, N], q [B, H, D], w [B, H]), under
`torch.cuda.set_sync_debug_mode("error")`, so a host sync inside the capture fails the check. Then for >= 100
steps: every request decodes one chunk (pages open, promote, spill), a quarter of the requests run a Level-1
recall with new pages (evictions, an exhausted reserve), now and then one finishes and its row is reused (a new
generation), fresh inputs are copied into the static buffers, the graph is replayed, and its outputs must equal,
bit for bit, three eager `Level2` instances run on the same inputs. Each step also checks the eager picks
against the engine: every valid pick's cell is that chunk's cell now, and (mask mode) its value is its logit.

On CPU the graph is skipped (with the reason) and the same steps check eager Level 2 against the engine.
"""

from __future__ import annotations

import random

import torch

from gpu_core.core import (
    CheckResult,
    EngineConfig,
    Level2,
    OffloadEngine,
    OffloadLayout,
    RecallRequest,
    Sizes,
    gen,
    random_engine_chunks,
    recall_sync,
)

MAX_ROWS_FULL = 128


class _Bench:
    """The engine, its live requests and the per-step churn."""

    def __init__(self, sz: Sizes, device: torch.device, seed: int):
        self.layout = OffloadLayout(
            n_layers=3,
            page_chunks=64,
            kv_widths=(8,),
            kv_align=1,
            index_head_dim=sz.dims.head_dim,
            target_layers=(0,),
            index_offload=True,
        )
        self.rows = max(sz.l2_batches)
        pages = self.layout.pages_for(sz.l2_max_chunks)
        self.cfg = EngineConfig(
            max_rows=self.rows,
            max_chunks=sz.l2_max_chunks,
            mirror_pages=self.rows * pages + 8,
            recall_blocks=max(1, self.rows * sz.l2_kmax * 3 // 4),
            decode_pages=2,
            max_resident_pages=sz.l2_kmax,
        )
        self.eng = OffloadEngine(self.layout, self.cfg, device)
        self.rng, self.g, self.sz, self.device = random.Random(seed), gen(seed), sz, device
        self.gens: dict[int, int] = {}
        for r in range(self.rows):
            self.admit(r)

    def admit(self, row: int) -> None:
        # room for every batch's decode steps (rows 0.. are in every batch)
        n = self.rng.randint(1, self.cfg.max_chunks - len(self.sz.l2_batches) * self.sz.l2_steps - 2)
        kv, ix = random_engine_chunks(self.layout, n, self.g)
        self.gens[row] = self.eng.admit(row, kv, ix)
        self.eng.open_tail_page(row)
        self.recall([row])

    def recall(self, rows: list[int]) -> None:
        reqs = []
        for r in rows:
            n_pages = self.layout.pages_for(self.eng.n_chunks(r))
            pages = self.rng.sample(range(n_pages), min(n_pages, self.rng.randint(1, self.cfg.max_resident_pages + 1)))
            prio = tuple(float("inf") if p == n_pages - 1 else self.rng.random() for p in pages)
            reqs.append(RecallRequest(r, self.gens[r], tuple(pages), prio))
        recall_sync(self.eng, reqs)

    def churn(self, batch_rows: list[int]) -> None:
        live = [r for r in batch_rows if r >= 0]
        kv, ix = random_engine_chunks(self.layout, len(live), self.g)
        self.eng.decode_append(live, kv, ix)
        self.recall(self.rng.sample(live, max(1, len(live) // 4)))
        if self.rng.random() < 0.2:
            r = self.rng.choice(live)
            self.eng.finish(r)
            self.admit(r)


def _outs(o) -> tuple[torch.Tensor, ...]:
    return (o.chunks.clone(), o.cells.clone(), o.values.clone())


def _verify(res: CheckResult, bench: _Bench, rows: torch.Tensor, logits: torch.Tensor, outs, step: int, b: int) -> bool:
    """Eager picks against the engine: valid picks are resident with their current cell; mask values are logits."""
    ok = True
    for mode, (chunks, cells, values) in outs.items():
        valid = chunks >= 0
        now = bench.eng.cells(rows.cpu(), chunks.clamp_min(0).cpu()).to(cells.device)
        if not torch.equal(torch.where(valid, now, -1), cells) or bool((valid & (cells < 0)).any()):
            ok = res.expect(False, f"batch {b} step {step}: {mode} picks a cell that is not the chunk's cell now")
        if bool((valid[rows < 0]).any()):
            ok = res.expect(False, f"batch {b} step {step}: {mode} picks chunks for a padding row")
        if mode == "mask":
            want = logits.gather(1, chunks.clamp_min(0))
            if not torch.equal(torch.where(valid, want, values), values):
                ok = res.expect(False, f"batch {b} step {step}: mask values are not the picked chunks' logits")
    return ok


def _one_batch(res: CheckResult, bench: _Bench, b: int, sz: Sizes, device: torch.device, use_graph: bool) -> dict:
    eng, hd, heads = bench.eng, sz.dims.head_dim, sz.native_heads
    n, k = sz.l2_max_chunks, sz.l2_topk
    rows_l = list(range(b)) if b == 1 else list(range(b - 1)) + [-1]  # the last entry of a batch is padding
    rows = torch.tensor(rows_l, device=device)
    logits = torch.zeros(b, n, device=device)
    q = torch.zeros(b, heads, hd, device=device)
    w = torch.zeros(b, heads, device=device)
    path_i = eng.layout.offload_index_layers[0]

    def calls(l2s: list[Level2]) -> dict:
        return {
            "mask": l2s[0].mask_topk(logits, rows, k),
            "resident_target": l2s[1].score_resident_topk(q, w, rows, 0, k),
            "resident_path_i": l2s[2].score_resident_topk(q, w, rows, path_i, k),
        }

    eager = [Level2(eng, max_batch=bench.rows, topk=k) for _ in range(3)]
    graph, g_outs = None, None
    if use_graph:
        cap = [Level2(eng, max_batch=bench.rows, topk=k) for _ in range(3)]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                calls(cap)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.cuda.set_sync_debug_mode("error")  # inside: entering the capture synchronizes by design
            try:
                g_outs = calls(cap)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    cpu_g = gen(1000 + b)
    equal_steps = 0
    for step in range(sz.l2_steps):
        bench.churn(rows_l)
        x = torch.randn(b, n, generator=cpu_g)
        n_hist = torch.tensor([eng.n_chunks(r) if r >= 0 else 0 for r in rows_l])
        x[torch.arange(n).unsqueeze(0) >= n_hist.unsqueeze(1)] = float("-inf")  # native logits end at the history
        logits.copy_(x)
        q.copy_(torch.randn(b, heads, hd, generator=cpu_g))
        w.copy_(torch.randn(b, heads, generator=cpu_g))
        ref = {m: _outs(o) for m, o in calls(eager).items()}
        if not _verify(res, bench, rows, logits, ref, step, b):
            break
        if graph is not None:
            graph.replay()
            got = {m: _outs(o) for m, o in g_outs.items()}
            diff = [m for m in ref if not all(torch.equal(x_, y_) for x_, y_ in zip(ref[m], got[m]))]
            if diff:
                res.fail(f"batch {b} step {step}: graph replay differs from eager in {diff}")
                break
        equal_steps += 1
    return dict(
        batch=b,
        steps=sz.l2_steps,
        steps_equal=equal_steps,
        graph=graph is not None,
        chunks=n,
        topk=k,
        resident_cap_pages=eng.res_cap,
    )


def run(sz: Sizes, device: torch.device, seed: int) -> CheckResult:
    res = CheckResult("b", "Level 2 (mask, score-resident) in a CUDA graph, residency changing between replays")
    use_graph = device.type == "cuda"
    if not use_graph:
        res.skipped.append("CUDA graph capture and replay: need CUDA (eager Level 2 checked against the engine)")
    bench = _Bench(sz, device, seed)
    rows = []
    for b in sz.l2_batches:
        rows.append(_one_batch(res, bench, b, sz, device, use_graph))
        res.figures[f"batch_{b}"] = rows[-1]
        if not res.ok:
            break
    what = "graph == eager" if use_graph else "eager == engine (no graph on CPU)"
    res.summary = f"{what} at batch {'/'.join(str(r['batch']) for r in rows)}: " + ", ".join(
        f"{r['steps_equal']}/{r['steps']} steps" for r in rows
    )
    return res
