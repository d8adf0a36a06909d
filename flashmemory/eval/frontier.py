"""`flashmemory eval frontier`: task quality against cost over a page-budget sweep, resumable.

Per held-out document (document i is task tasks[i % len(tasks)] with seed seed * 1000 + i, i from `first_doc` on,
as in `eval quality`): the prompt is prefilled once and Full attention decodes greedily from that cache
(`eval.frontier_decode`); one capture forward gives the indexer's picks, keys and hidden states. Then at every
budget b (a share of the document's pages: KMAX = ceil(b x pages)) the harness (`eval.harness.evaluate_doc`)
replays each method through the offload engine and Level 1 and decodes its Level-2 forward from the shared
prefix. HiSparse keeps Full's outputs by construction; its cost at a hot buffer of H = KMAX x page_chunks slots
comes from replaying sglang 0.5.23's LRU swap-in over the Full run's own top-k picks of every c4 layer
(`eval.hisparse_replay`); "HiSparse+prefetch" adds FlashMemory's resident set as a prefetch hint at each
Level-1 cycle (at most H - k positions, so it never evicts a current pick). Every method row gains its costs
(`eval.frontier_cost.method_costs`).

Speed: the harness replays every budget coverage-only, then the Level-2 forwards of all (budget, method) resident
sets run as one batched decode from the shared prompt cache (`PrefixDecoder.forward_many`; equal sets, e.g. every
method at budget 1, once) and `method_quality` completes the rows from those logits (`Sweep._quality_batched`).
The record is the one the one-forward-per-method path writes (tests/eval/test_frontier_decode.py checks it).

Budgets are stated as a share of history and as resident chunks per top-k (KMAX x page_chunks / index_topk).

Resumable: each document's record goes atomically to out/docs/<i>.json with the run's fingerprint (everything
its numbers depend on but the document count); a rerun skips finished documents, a record of another
configuration stops the run naming its file, and the output dir is locked (`flashmemory.outdir.DirLock`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashmemory.errors import UserError
from flashmemory.eval.records import DOCS_DIR, file_digest, load_records

FORMAT = "flashmemory-frontier/1"
TRAINED_TASKS = ("niah_single", "niah_multikey", "mqar")
SWEEP_METHODS = ("FlashMemory", "FlashMemory+monitor", "Oracle", "Recency")
PREFETCH = "HiSparse+prefetch"  # HiSparse whose hot buffer is also loaded with FlashMemory's set each cycle
QUALITY_KEYS = ("agreement", "mass", "golden_recall", "task_score", "resident_frac")


@dataclass(frozen=True)
class FrontierConfig:
    """One frontier run. budgets: page shares in (0, 1]; methods: `eval.methods.METHODS` names run through the
    harness (Full and HiSparse always run); model: a tiny model name or checkpoint dir ("" = the shipped trained
    model); retriever: a retriever checkpoint (required); doc_len: prompt tokens; the rest as `eval quality`'s
    demo settings (tau and gen_tokens in decode steps, page_chunks and tail_chunks in c4 chunks)."""

    out_dir: str
    retriever: str
    n_per_task: int = 24
    budgets: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0)
    methods: tuple[str, ...] = SWEEP_METHODS
    tasks: tuple[str, ...] = TRAINED_TASKS
    model: str = ""
    doc_len: int = 4096
    gen_tokens: int = 24
    tau: int = 16
    page_chunks: int = 8
    tail_chunks: int = 8
    threshold: float = 0.5
    topp: float = 0.6
    min_layers: int = 2
    first_doc: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        from flashmemory.eval.methods import EXTRA_METHODS, METHODS
        from flashmemory.tasks.suite import TASKS

        known = METHODS + EXTRA_METHODS
        if self.n_per_task < 1:
            raise UserError(f"--n-per-task {self.n_per_task}: must be >= 1")
        if len(self.budgets) < 1 or any(not 0.0 < b <= 1.0 for b in self.budgets):
            raise UserError(f"--budgets {','.join(map(str, self.budgets))}: give fractions in (0, 1]")
        bad = [m for m in self.methods if m not in known]
        if bad or not self.methods:
            raise UserError(f"--methods: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(known)}")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise UserError(f"--tasks: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(TASKS)}")
        for name, lo in (
            ("doc_len", 64),
            ("gen_tokens", 2),
            ("tau", 1),
            ("page_chunks", 1),
            ("tail_chunks", 0),
            ("first_doc", 0),
        ):
            if getattr(self, name) < lo:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= {lo}")
        if not (math.isfinite(self.threshold) and 0.0 <= self.threshold <= 1.0):
            raise UserError(f"--threshold {self.threshold}: must lie in [0, 1]")
        if not 0 <= self.seed < 2**20:
            raise UserError(f"--seed {self.seed}: must lie in [0, 2**20)")


def doc_plan(fc: FrontierConfig) -> list[tuple[int, str]]:
    """[(document index, task)]: n_per_task documents of each task, tasks cycling from index first_doc."""
    out = []
    for j in range(fc.n_per_task * len(fc.tasks)):
        i = fc.first_doc + j
        out.append((i, fc.tasks[i % len(fc.tasks)]))
    return out


def fingerprint(fc: FrontierConfig) -> str:
    """sha256 (16 hex) of everything a document's numbers depend on (not out_dir or n_per_task)."""
    key = {k: v for k, v in asdict(fc).items() if k not in ("out_dir", "n_per_task", "retriever")}
    key["model"] = Path(fc.model).name if fc.model else "shipped"
    key["retriever"] = file_digest(fc.retriever, "--retriever")
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_done(out: Path, fp: str) -> dict[int, dict]:
    """{document index: record} of the finished documents under out/docs (`eval.records`)."""
    return load_records(out, fp, FORMAT, "a frontier run", "--out")


def hisparse_stats(run, slots: int, hint: dict[int, torch.Tensor] | None = None) -> dict | None:
    """HiSparse's LRU swap-in replayed over the Full run's decode-row picks of every c4 layer with a hot buffer of
    `slots` entries: {"hits", "misses", "hit_rate", "fast_path_calls", "calls"} summed over layers and steps
    (sglang's PD admission: a request longer than the buffer starts it empty; hit rate 1 on the fast path,
    history <= slots); None while the replay module is not installed (the report then marks the HiSparse cost
    columns pending)."""
    try:
        from flashmemory.eval.hisparse_replay import replay_hisparse
    except ImportError:
        return None
    P, T = run.prompt_len, run.n_steps
    picks = []
    for c in sorted(run.topk):
        rows = run.topk[c][P : P + T]
        picks.append([r[r >= 0].long() for r in rows])
    lengths = [min((P + t + 1) // 4, run.index_chunks.shape[1]) for t in range(T)]
    st = replay_hisparse(picks, lengths, slots, hint)
    out = {
        "hits": float(st.hits),
        "misses": float(st.misses),
        "hit_rate": float(st.hit_rate),
        "fast_path_calls": float(st.fast_path_calls),
        "calls": float(st.calls),
    }
    if hint is not None:
        out |= {
            "prefetched": float(st.prefetched),
            "prefetch_hits": float(st.prefetch_hits),
            "prefetch_wasted": float(st.prefetch_wasted),
        }
    return out


def prefetch_hint(resident: torch.Tensor, tau: int) -> dict[int, torch.Tensor]:
    """FlashMemory's resident set at each Level-1 cycle start (step t, t % tau == 0) as a HiSparse prefetch hint:
    step -> its resident chunk positions, ascending (the replay keeps the first slots - k). resident: bool [T, N_c]."""
    return {t: resident[t].nonzero().squeeze(1) for t in range(0, resident.shape[0], tau)}


class Sweep:
    """The loaded model, retriever and tokenizer of one run; `doc(i, task)` computes one document's record body."""

    def __init__(self, fc: FrontierConfig):
        from flashmemory.eval.frontier_cost import level1_flops, tiny_shapes
        from flashmemory.eval.harness import HarnessConfig
        from flashmemory.eval.monitored import MonitorEvalConfig
        from flashmemory.hf import HFEngine
        from flashmemory.retriever.checkpoint import check_fits, load_retriever
        from flashmemory.tasks.tokenizer import load_tokenizer
        from flashmemory.tiny.attention import use_band_attention
        from flashmemory.tiny.shipped import trained_model_available, trained_model_dir

        if not fc.model and not trained_model_available():
            raise UserError("flashmemory eval frontier: the shipped trained model is missing and no --model given")
        self.fc = fc
        self.engine = HFEngine.from_name(fc.model or str(trained_model_dir()), seed=fc.seed)
        use_band_attention(self.engine.model)
        self.retriever = load_retriever(fc.retriever).eval()
        self.targets = tuple(self.retriever.layers)
        check_fits(self.retriever, fc.retriever, self.engine.hidden_size, self.engine.index_head_dim, self.targets)
        self.tok = load_tokenizer(None)
        self.hc = HarnessConfig(
            tau=fc.tau,
            page_chunks=fc.page_chunks,
            tail_chunks=fc.tail_chunks,
            threshold=fc.threshold,
            seed=fc.seed,
            methods=fc.methods,
            monitor=MonitorEvalConfig(search_from_target=True),
        )
        self.shapes = tiny_shapes(self.engine, self.retriever, fc.tau, fc.page_chunks)
        self._l1 = level1_flops

    def text(self, ids: list[int]) -> str:
        return self.tok.decode([i if 0 <= i < self.tok.vocab_size else self.tok.unk for i in ids])

    def doc(self, i: int, task: str, batched: bool = True) -> dict:
        """{"budgets": {budget: {method: metrics + costs}}, "n_chunks", "prompt_len"} of document i.

        batched: every (budget, method) Level-2 forward in one batched decode (`_quality_batched`); False runs
        each through the harness one at a time. Both give the same record (up to float error in the logits)."""
        from flashmemory.eval.frontier_decode import cached_full_run
        from flashmemory.eval.harness import evaluate_doc
        from flashmemory.tasks.suite import generate

        fc, eng = self.fc, self.engine
        it = generate(task, fc.doc_len, n=1, seed=fc.seed * 1000 + i, tokenizer=self.tok)[0]
        with torch.no_grad():
            run, dec = cached_full_run(
                eng,
                f"{task}-{i}",
                self.tok.encode_chat(it.messages),
                fc.gen_tokens,
                self.targets,
                fc.topp,
                min(fc.min_layers, eng.n_c4_layers),
                it.to_record(),
            )
            per_budget: dict[float, tuple[dict, dict]] = {}
            for b in fc.budgets:
                residents: dict = {}
                rows = evaluate_doc(
                    dec,
                    run,
                    self.retriever,
                    self.hc,
                    self.targets,
                    b,
                    self.text,
                    quality=not batched,
                    residents=residents,
                )
                per_budget[b] = (rows, residents)
            if batched:
                self._quality_batched(run, dec, per_budget)
        return self._record(run, dec, per_budget)

    def _quality_batched(self, run, dec, per_budget: dict[float, tuple[dict, dict]]) -> None:
        """Complete coverage-only harness rows (`evaluate_doc(quality=False)`) into the rows `quality=True`
        gives, in the same key order: Full's row first, then each method's replay fields followed by
        `method_quality`'s, whose Level-2 logits come from one `PrefixDecoder.forward_many` over every
        (budget, method) resident set of the document."""
        from flashmemory.eval.decode import method_quality, query_mask
        from flashmemory.eval.frontier_decode import ServedLogits
        from flashmemory.eval.harness import kmax_for

        eng, P, T = self.engine, run.prompt_len, run.n_steps
        n_vis = torch.tensor([min((P + t + 1) // 4, run.index_chunks.shape[1]) for t in range(T)])
        masks = [query_mask(run, r) for _, res in per_budget.values() for r in res.values()]
        served = ServedLogits(eng.index_topk, P, masks, dec.forward_many(run.ids, masks))
        full = method_quality(eng, run, None, n_vis, self.targets, self.text)
        for b, (rows, residents) in per_budget.items():
            out = {
                "Full": full | {"recall_bytes": 0.0, "level1_share": 0.0, "kmax": kmax_for(run, b, self.fc.page_chunks)}
            }
            for name, m in rows.items():
                q = method_quality(served, run, residents[name], n_vis, self.targets, self.text)
                out[name] = {k: v for k, v in m.items() if k not in q} | q
            rows.clear()
            rows.update(out)

    def _record(self, run, dec, per_budget: dict[float, tuple[dict, dict]]) -> dict:
        """The record body from the harness rows of every budget: HiSparse's arms and every row's costs."""
        from flashmemory.eval.frontier_cost import method_costs

        fc, eng = self.fc, self.engine
        n_c4, n_final, cb = run.index_chunks.shape
        T, P = run.n_steps, run.prompt_len
        n_vis = torch.tensor([min((P + t + 1) // 4, n_final) for t in range(T)]).float()
        shape = dict(
            n_c4=n_c4,
            n_target=len(self.targets),
            n_final=n_final,
            n_vis_mean=float(n_vis.mean()),
            n_steps=T,
            index_bytes=cb,
            page_chunks=fc.page_chunks,
            tau=fc.tau,
            l1_flops=self._l1(P + T, *self.shapes),
        )
        budgets = {}
        for b, (rows, residents) in per_budget.items():
            kmax = int(rows["Full"]["kmax"])
            slots = max(kmax * fc.page_chunks, eng.index_topk)
            arms = {"HiSparse": hisparse_stats(run, slots)}
            if "FlashMemory" in residents:
                arms[PREFETCH] = hisparse_stats(run, slots, prefetch_hint(residents["FlashMemory"], fc.tau))
            for arm, hs in arms.items():
                rows[arm] = {k: rows["Full"][k] for k in QUALITY_KEYS if k in rows["Full"]} | {
                    "kmax": kmax,
                    "hot_slots": slots,
                    **(hs or {"hit_rate": float("nan")}),
                    "cost_pending": hs is None,
                }
            for name, m in rows.items():
                m.pop("miss_values", None)
                m |= method_costs(name, m, hot_slots=slots, swap_misses=(hs or {}).get("misses"), **shape)
                m["resident_per_topk"] = (
                    n_final if name == "Full" else min(kmax * fc.page_chunks, n_final)
                ) / eng.index_topk
            budgets[f"{b:g}"] = rows
        return {
            "budgets": budgets,
            "n_chunks": n_final,
            "prompt_len": P,
            "index_topk": eng.index_topk,
            "forced_forwards": dec.forced_forwards,
        }


def run_frontier(
    fc: FrontierConfig,
    log=print,
    progress: bool = True,
    report_only: bool = False,
    max_docs: int | None = None,
    compare: str | None = None,
) -> dict:
    """Run (or continue) the sweep in fc.out_dir and write frontier.json / .md / .png from the finished
    documents; returns the aggregate. max_docs: stop after this many new documents (the rest stay pending);
    compare: another frontier out dir whose extra methods frontier.md sets beside FlashMemory
    (`eval.frontier_compare`)."""
    from flashmemory.outdir import DirLock, prepare_dir

    out = prepare_dir(fc.out_dir, "--out")
    with DirLock(out, "frontier output directory"):
        return _run(fc, out, log, progress, report_only, max_docs, compare)


def _run(
    fc: FrontierConfig,
    out: Path,
    log,
    progress: bool,
    report_only: bool,
    max_docs: int | None,
    compare: str | None = None,
) -> dict:
    from tqdm import tqdm

    from flashmemory.atomic import atomic_write_text
    from flashmemory.eval.frontier_report import write_outputs

    fp = fingerprint(fc)
    plan = doc_plan(fc)
    done = load_done(out, fp)
    todo = [(i, t) for i, t in plan if i not in done]
    if max_docs is not None:
        todo = todo[:max_docs]
    log(
        f"[frontier] {len(plan)} documents ({fc.n_per_task} per task), {len(done)} done earlier, "
        f"{len(todo)} to run now; budgets {', '.join(f'{b:g}' for b in fc.budgets)}; fingerprint {fp}"
    )
    if todo and not report_only:
        sw = Sweep(fc)
        for i, task in tqdm(todo, desc="frontier: documents", disable=not progress, unit="doc"):
            t0 = time.perf_counter()
            body = sw.doc(i, task)
            rec = {
                "format": FORMAT,
                "fingerprint": fp,
                "index": i,
                "task": task,
                "seconds": time.perf_counter() - t0,
                **body,
            }
            atomic_write_text(out / DOCS_DIR / f"{i:05d}.json", json.dumps(rec, allow_nan=True))
            done[i] = rec
            log(f"[frontier] document {i} ({task}) done in {rec['seconds']:.0f} s")
    recs = [done[i] for i, _ in plan if i in done]
    if not recs:
        raise UserError(f"--out {out}: no finished documents to report")
    extra = None
    if compare:
        from flashmemory.eval.frontier_compare import compare_lines

        extra = compare_lines(recs, compare, FORMAT)
    return write_outputs(recs, fc, fp, len(plan), out, log, extra, compare)
