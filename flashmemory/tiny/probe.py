"""Does the model's attention retrieve? Three measurements on held-out documents.

1. Accuracy under Full attention (teacher-forced exact match of the answer = greedy reproducing it).
2. Accuracy with the c4 entries of the answer's evidence masked in every c4 layer (the Level-2 residency
   mask of `flashmemory.hf.capture`: never picked, never attended), against masking as many random
   visible c4 entries that do not touch the evidence. c128 entries and the sliding window are untouched.
3. Native indexer top-k recall of the evidence entries at answer steps: for each answer token whose
   owner is an answer (not a separator), in each c4 layer, whether the top-k picks of the query that
   predicts it hold all (`recall_all`) / any (`recall_any`) of that answer's evidence entries.

c4 entry j pools tokens [4j - 4, 4j + 4), so it touches the span [a, b) iff 4j - 4 < b and 4j + 4 > a.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from flashmemory.tiny.data import Doc


def evidence_entries(spans: list[tuple[int, int]], ratio: int = 4) -> list[int]:
    """Sorted c4 entries whose pooled tokens [r*j - r, r*j + r) overlap any span [a, b)."""
    out: set[int] = set()
    for a, b in spans:
        for j in range(max(0, (a - ratio) // ratio), (b + ratio) // ratio + 1):
            if ratio * j - ratio < b and ratio * j + ratio > a:
                out.add(j)
    return sorted(out)


@dataclass(frozen=True)
class ProbeRow:
    task: str
    n_docs: int
    acc_full: float
    acc_mask_answer: float
    acc_mask_random: float
    tok_acc_full: float
    tok_acc_mask_answer: float
    tok_acc_mask_random: float
    masked_entries: float  # mean c4 entries masked per document (both masking conditions)
    recall_all: float  # share of (answer step, c4 layer) whose top-k holds all evidence entries
    recall_any: float
    recall_token: float  # ... holds an entry pooling the very source token this step reproduces
    recall_token_by_layer: tuple[float, ...]  # recall_token per c4 layer
    n_answer_steps: int  # (answer step, c4 layer) pairs behind recall_all / recall_any


def _answer_ok(logits: torch.Tensor, doc: Doc) -> tuple[bool, int, int]:
    pred = logits[doc.n_prompt - 1 : len(doc.ids) - 1].argmax(-1).tolist()
    ok = [p == t for p, t in zip(pred, doc.ids[doc.n_prompt :])]
    return all(ok), sum(ok), len(ok)


def probe_docs(engine, docs: list[Doc], seed: int = 0) -> list[ProbeRow]:
    """One row per task (in first-seen order) plus an 'all' row; `engine` is an `HFEngine`."""
    rng = random.Random(seed)
    per: dict[str, dict[str, list]] = {}
    for doc in docs:
        ents = sorted({j for sp in doc.spans for j in evidence_entries(sp, engine.ratio)})
        n_vis = doc.n_prompt // engine.ratio
        cap = engine.forward(doc.ids)
        full = _answer_ok(cap.logits, doc)
        mask = torch.ones(len(doc.ids) // engine.ratio, dtype=torch.bool)
        mask[ents] = False
        masked = _answer_ok(engine.forward(doc.ids, resident=mask).logits, doc)
        pool = [j for j in range(n_vis) if j not in set(ents)]
        rmask = torch.ones_like(mask)
        rmask[rng.sample(pool, min(len(ents), len(pool)))] = False
        rand = _answer_ok(engine.forward(doc.ids, resident=rmask).logits, doc)
        hits_all, hits_any, hits_tok = [], [], []
        first = {}
        for i, k in enumerate(doc.owner):
            if k < 0:
                continue
            first.setdefault(k, i)
            want = set(evidence_entries(doc.spans[k], engine.ratio))
            if not want:
                continue
            t = doc.n_prompt - 1 + i
            # the source token this step copies, when the evidence is a verbatim copy of the answer
            owned = sum(1 for o in doc.owner if o == k)
            src = [a + i - first[k] for a, b in doc.spans[k] if b - a == owned]
            tok_want = set(evidence_entries([(p, p + 1) for p in src], engine.ratio))
            for c, topk in sorted(cap.topk.items()):
                picked = set(topk[t][topk[t] >= 0].tolist())
                hits_all.append(want <= picked)
                hits_any.append(bool(want & picked))
                if tok_want:
                    hits_tok.append((c, bool(tok_want & picked)))
        d = per.setdefault(doc.task, {k: [] for k in ("full", "mask", "rand", "n", "all", "any", "tok")})
        d["full"].append(full)
        d["mask"].append(masked)
        d["rand"].append(rand)
        d["n"].append(len(ents))
        d["all"] += hits_all
        d["any"] += hits_any
        d["tok"] += hits_tok

    def row(task: str, ds: list[dict]) -> ProbeRow:
        def cat(key):
            return [x for d in ds for x in d[key]]

        def acc(key):
            xs = cat(key)
            return sum(x[0] for x in xs) / len(xs), sum(x[1] for x in xs) / max(1, sum(x[2] for x in xs))

        (af, tf), (am, tm), (ar, tr) = acc("full"), acc("mask"), acc("rand")
        n, al, an, tk = cat("n"), cat("all"), cat("any"), cat("tok")
        nan = float("nan")

        def mean(xs):
            return sum(xs) / len(xs) if xs else nan

        layers = sorted({c for c, _ in tk})
        by_layer = tuple(mean([h for c, h in tk if c == lay]) for lay in layers)
        return ProbeRow(
            task,
            len(cat("full")),
            af,
            am,
            ar,
            tf,
            tm,
            tr,
            sum(n) / len(n),
            mean(al),
            mean(an),
            mean([h for _, h in tk]),
            by_layer,
            len(al),
        )

    rows = [row(t, [d]) for t, d in per.items()]
    if len(rows) > 1:
        rows.append(row("all", list(per.values())))
    return rows


def probe_table(rows: list[ProbeRow], index_topk: int) -> str:
    """Markdown table of probe rows."""
    head = (
        "| task | docs | acc Full | acc answer c4 masked | acc random c4 masked | answer-token acc Full / "
        f"masked / random | entries masked | indexer top-{index_topk} recall all / any / copied token "
        "(step x layer pairs) | copied-token recall per c4 layer |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.task} | {r.n_docs} | {r.acc_full:.3f} | {r.acc_mask_answer:.3f} | "
            f"{r.acc_mask_random:.3f} | "
            f"{r.tok_acc_full:.3f} / {r.tok_acc_mask_answer:.3f} / {r.tok_acc_mask_random:.3f} | "
            f"{r.masked_entries:.1f} | {r.recall_all:.3f} / {r.recall_any:.3f} / {r.recall_token:.3f} "
            f"({r.n_answer_steps}) | {' / '.join(f'{x:.2f}' for x in r.recall_token_by_layer)} |"
        )
    return "\n".join(lines)


def rows_json(rows: list[ProbeRow]) -> list[dict]:
    return [asdict(r) for r in rows]
