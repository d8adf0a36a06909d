"""`flashmemory eval frontier`: task quality against cost over a page-budget sweep, resumable.

Per held-out document (document i is task tasks[i % len(tasks)] with seed seed * 1000 + i, i from `first_doc` on,
as in `eval quality`): the prompt is prefilled once and Full attention decodes greedily from that cache
(`eval.frontier.decode`); one capture forward gives the indexer's picks, keys and hidden states. Then at every
budget b (a share of the document's pages: KMAX = ceil(b x pages)) the harness (`eval.harness.evaluate_doc`)
replays each method through the offload engine and Level 1 and decodes its Level-2 forward from the shared
prefix. HiSparse keeps Full's outputs by construction; its cost at a hot buffer of H = KMAX x page_chunks slots
comes from replaying sglang 0.5.23's LRU swap-in over the Full run's own top-k picks of every c4 layer
(`eval.hisparse_replay`); "HiSparse+prefetch" adds FlashMemory's resident set as a prefetch hint at each
Level-1 cycle (at most H - k positions, so it never evicts a current pick). Every method row gains its costs
(`eval.frontier.cost.method_costs`).

Speed: the harness replays every budget coverage-only, then the Level-2 forwards of all (budget, method) resident
sets run as one batched decode from the shared prompt cache (`PrefixDecoder.forward_many`; equal sets, e.g. every
method at budget 1, once) and `method_quality` completes the rows from those logits (`Sweep._quality_batched`).
The record is the one the one-forward-per-method path writes (tests/eval/frontier/test_decode.py checks it).

Budgets are stated as a share of history and as resident chunks per top-k (KMAX x page_chunks / index_topk).

Resumable: each document's record goes atomically to out/docs/<i>.json with the run's settings and their
fingerprint (everything its numbers depend on but the document count, the model and retriever by content:
`eval.frontier.identity`); a rerun skips finished documents, a record of another configuration stops the run naming
its file, the output dir is locked (`flashmemory.outdir.DirLock`) and marked as a frontier run's (an `eval quality`
dir is refused, and the reverse). Records of the older fingerprint scheme are read for the report (--report-only)
but never extended with new ones. Records also carry the revision of the cost computation their cost fields come
from (cost_rev); a run refuses records whose HiSparse costs are of an older revision, and `--recost` recomputes
them from each record's stored per-arm stats without running a model (`eval.frontier.recost`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashmemory.errors import UserError
from flashmemory.eval.budgets import budget_key, check_distinct
from flashmemory.eval.frontier.hisparse import hisparse_stats, prefetch_hint
from flashmemory.eval.frontier.identity import TRAINED_TASKS, harness_config
from flashmemory.eval.frontier.recost import COST_REV
from flashmemory.eval.records import DOCS_DIR, check_n_per_task, check_tasks, claim_run_dir, load_records

FORMAT = "flashmemory-frontier/1"
SWEEP_METHODS = ("FlashMemory", "FlashMemory+monitor", "Oracle", "Recency")
PREFETCH = "HiSparse+prefetch"  # HiSparse whose hot buffer is also loaded with FlashMemory's set each cycle
QUALITY_KEYS = ("agreement", "mass", "golden_recall", "task_score", "resident_frac")
RECORD_FIELDS = ("seconds", "n_chunks", "prompt_len", "index_topk")  # what the report reads besides budgets


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
        check_n_per_task(self.n_per_task)
        if len(self.budgets) < 1 or any(not 0.0 < b <= 1.0 for b in self.budgets):
            raise UserError(f"--budgets {','.join(map(str, self.budgets))}: give fractions in (0, 1]")
        check_distinct(self.budgets)
        bad = [m for m in self.methods if m not in known]
        if bad or not self.methods:
            raise UserError(f"--methods: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(known)}")
        if not self.tasks:
            raise UserError(f"--tasks: none given; choose from {', '.join(TRAINED_TASKS)}")
        # the shipped model takes `eval quality`'s tasks; another model's are checked by content in settings()
        check_tasks(self.tasks, TRAINED_TASKS if not self.model else tuple(TASKS), "the trained model's")
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
    """sha256 (16 hex) of the run's settings (`eval.frontier.identity.settings`: not out_dir or n_per_task)."""
    from flashmemory.eval.frontier.identity import fingerprint_of, settings

    return fingerprint_of(settings(fc))


def load_done(out: Path, fp: str, fc: FrontierConfig | None = None) -> dict[int, dict]:
    """{document index: record} of the finished documents under out/docs (`eval.records`). With `fc`, records of
    the legacy fingerprint scheme are read when their fingerprint is this configuration's with the shipped model
    (`eval.frontier.identity`); each such record gets "legacy": True."""
    from flashmemory.eval.frontier.identity import legacy_reader

    legacy = legacy_reader(fc) if fc is not None else None
    keys = tuple(budget_key(b) for b in fc.budgets) if fc is not None else None
    return load_records(out, fp, FORMAT, "a frontier run", "--out", keys, RECORD_FIELDS, legacy)


class Sweep:
    """The loaded model, retriever and tokenizer of one run; `doc(i, task)` computes one document's record body."""

    def __init__(self, fc: FrontierConfig):
        from flashmemory.eval.frontier.cost import level1_flops, tiny_shapes
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
        self.hc = harness_config(fc)
        self.shapes = tiny_shapes(self.engine, self.retriever, fc.tau, fc.page_chunks)
        self._l1 = level1_flops

    def text(self, ids: list[int]) -> str:
        return self.tok.decode([i if 0 <= i < self.tok.vocab_size else self.tok.unk for i in ids])

    def doc(self, i: int, task: str, batched: bool = True) -> dict:
        """{"budgets": {budget: {method: metrics + costs}}, "n_chunks", "prompt_len"} of document i.

        batched: every (budget, method) Level-2 forward in one batched decode (`_quality_batched`); False runs
        each through the harness one at a time. Both give the same record (up to float error in the logits)."""
        from flashmemory.eval.frontier.decode import cached_full_run
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
        from flashmemory.eval.frontier.decode import ServedLogits
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
        from flashmemory.eval.frontier.cost import method_costs

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
                own = arms.get(name) or {}  # a HiSparse arm's own replay; no swap-in misses for any other row
                m |= method_costs(name, m, hot_slots=slots, swap_misses=own.get("misses"), **shape)
                m["resident_per_topk"] = (
                    n_final if name == "Full" else min(kmax * fc.page_chunks, n_final)
                ) / eng.index_topk
            budgets[budget_key(b)] = rows
        return {
            "budgets": budgets,
            "n_chunks": n_final,
            "prompt_len": P,
            "index_topk": eng.index_topk,
            "forced_forwards": dec.forced_forwards,
            "cost_rev": COST_REV,
        }


def run_frontier(
    fc: FrontierConfig,
    log=print,
    progress: bool = True,
    report_only: bool = False,
    max_docs: int | None = None,
    compare: str | None = None,
    recost: bool = False,
) -> dict:
    """Run (or continue) the sweep in fc.out_dir and write frontier.json / .md / .png from the finished
    documents; returns the aggregate. max_docs: stop after this many new documents (the rest stay pending);
    compare: another frontier out dir whose extra methods frontier.md sets beside FlashMemory
    (`eval.frontier.compare`); recost: first recompute the finished records' HiSparse costs from their stats
    (`eval.frontier.recost`), then report them (no document runs)."""
    from flashmemory.outdir import DirLock, prepare_dir

    out = prepare_dir(fc.out_dir, "--out")
    with DirLock(out, "frontier output directory"):
        claim_run_dir(out, FORMAT, "--out")
        return _run(fc, out, log, progress, report_only or recost, max_docs, compare, recost)


def _run(
    fc: FrontierConfig,
    out: Path,
    log,
    progress: bool,
    report_only: bool,
    max_docs: int | None,
    compare: str | None = None,
    recost: bool = False,
) -> dict:
    from tqdm import tqdm

    from flashmemory.atomic import atomic_write_text
    from flashmemory.eval.frontier.identity import fingerprint_of, settings
    from flashmemory.eval.frontier.recost import check_current, recost_run
    from flashmemory.eval.frontier.report import write_outputs

    key = settings(fc)
    fp = fingerprint_of(key)
    plan = doc_plan(fc)
    done = load_done(out, fp, fc)
    if recost:
        recost_run(out, done, log)
    todo = [(i, t) for i, t in plan if i not in done]
    if max_docs is not None:
        todo = todo[:max_docs]
    old = [i for i, r in done.items() if r.get("legacy")]
    if todo and not report_only and old:
        raise UserError(
            f"--out {out}: its documents (e.g. {DOCS_DIR}/{old[0]:05d}.json) were written before records carried "
            "their settings; report them with --report-only, or run new documents into another --out"
        )
    check_current(out, done)
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
                "settings": key,
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
        from flashmemory.eval.frontier.compare import compare_lines

        extra = compare_lines(recs, compare, FORMAT, fc=fc)
    return write_outputs(recs, fc, fp, len(plan), out, log, extra, compare)
