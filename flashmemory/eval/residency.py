"""Resident pages per request against context length, on a control document with no relevant context.

The control document is filler text (`tasks.haystack` sentences) with no needle and no question about it: a
retriever that only keeps what decode needs should keep about the same few pages whatever the length. Each
length runs one teacher-forced forward of the CPU engine (prompt + `gen_tokens` more filler tokens, no
generation needed: nothing in the text is asked for), then replays decode through the offload engine and Level 1
for FlashMemory and FlashMemory+monitor at a FIXED page budget (KMAX pages, not a fraction of the context), and
reports the mean and max resident pages (recalled + decode region) over the decode steps.

`extend_costmodel` carries the measured per-request page counts to serving lengths (128K-1M tokens) with the
cost model's entry sizes: device c4 KV bytes per request for Full (grows with the context) against a resident
set of the measured pages (flat when residency is flat), at serving pages of 64 chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmemory.eval.monitored import MonitorEvalConfig, mean_resident_pages, monitor_factory
from flashmemory.eval.replay import replay_doc
from flashmemory.residency.level1 import retriever_scorer
from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy


@dataclass(frozen=True)
class ResidencyConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)  # prompt tokens
    gen_tokens: int = 32
    kmax: int = 6  # fixed resident page budget (pages of `page_chunks` chunks)
    page_chunks: int = 8
    tau: int = 16
    tail_chunks: int = 8
    threshold: float = 0.5
    seed: int = 0


def control_ids(tok, n_tokens: int, seed: int = 0) -> list[int]:
    """Token ids of `n_tokens` filler tokens: sentences with nothing to retrieve."""
    from flashmemory.tasks.haystack import SentenceStream

    stream = SentenceStream(f"control-{seed}", tok)
    ids: list[int] = []
    k = 64
    while len(ids) < n_tokens:
        ids = tok.encode(" ".join(s for s, _ in stream.take(k)))
        k *= 2
    return ids[:n_tokens]


def residency_row(
    engine, retriever, ids: list[int], prompt_len: int, rc: ResidencyConfig, mc: MonitorEvalConfig = MonitorEvalConfig()
) -> dict:
    """One length: mean/max resident pages of FlashMemory and FlashMemory+monitor, and the monitor's miss mass."""
    from flashmemory.hf import stored_index_keys

    targets = tuple(retriever.layers)
    cap = engine.forward(ids, capture_layers=None)
    chunks = torch.stack([stored_index_keys(cap.index_keys[c]) for c in range(engine.n_c4_layers)])
    hidden = {c: cap.hidden[c] for c in targets}
    logits = {c: cap.index_logits[c] for c in targets}
    del cap
    n_steps = len(ids) - prompt_len
    sel = SelectionConfig(
        threshold=rc.threshold, last_keep=rc.tail_chunks, page_chunks=rc.page_chunks, kmax=2 * rc.kmax
    )
    method = lambda eng: (retriever_scorer(retriever, eng, sel.ensemble), ThresholdPagePolicy(sel))  # noqa: E731
    common = dict(page_chunks=rc.page_chunks, tau=rc.tau, last_keep=rc.tail_chunks, target_layers=targets)
    fm = replay_doc(chunks, hidden, prompt_len, n_steps, method, kmax=rc.kmax, **common)
    mon = replay_doc(
        chunks,
        hidden,
        prompt_len,
        n_steps,
        method,
        kmax=rc.kmax,
        page_cap=2 * rc.kmax,
        monitor=monitor_factory(logits, targets, rc.kmax, 2 * rc.kmax, engine.index_topk, mc),
        **common,
    )

    def pages(rep) -> tuple[float, int]:
        t, n = rep.resident.shape
        pad = (-n) % rc.page_chunks
        per = torch.nn.functional.pad(rep.resident, (0, pad)).view(t, -1, rc.page_chunks).any(-1).sum(1)
        return mean_resident_pages(rep.resident, rc.page_chunks), int(per.max())

    miss = mon.metrics.get("miss_values", [])
    (fm_mean, fm_max), (mon_mean, mon_max) = pages(fm), pages(mon)
    return {
        "tokens": prompt_len,
        "kmax": rc.kmax,
        "chunks": int(chunks.shape[1]),
        "pages": -(-int(chunks.shape[1]) // rc.page_chunks),
        "fm_pages_mean": fm_mean,
        "fm_pages_max": fm_max,
        "mon_pages_mean": mon_mean,
        "mon_pages_max": mon_max,
        "miss_mass_mean": sum(miss) / len(miss) if miss else float("nan"),
        "miss_values": miss,
        "escalations": int(mon.metrics.get("escalations", 0)),
        "fallbacks": int(mon.metrics.get("fallbacks", 0)),
    }


def residency_vs_length(engine, retriever, tok, rc: ResidencyConfig = ResidencyConfig(), log=print) -> list[dict]:
    rows = []
    for n in rc.lengths:
        ids = control_ids(tok, n + rc.gen_tokens, rc.seed)
        rows.append(residency_row(engine, retriever, ids, n, rc))
        log(
            f"       residency at {n} tokens: FlashMemory {rows[-1]['fm_pages_mean']:.2f} pages, "
            f"+monitor {rows[-1]['mon_pages_mean']:.2f}"
        )
    return rows


SERVING_LENGTHS = (131072, 262144, 524288, 1048576)


def extend_costmodel(
    rows: list[dict], kmax_serving: int = 96, lengths: tuple[int, ...] = SERVING_LENGTHS
) -> list[dict]:
    """Device c4 KV bytes per request at serving lengths: Full against the measured residency.

    The measured page counts (tiny pages) are taken relative to the fixed budget: the largest observed
    mean-pages / KMAX ratio of each method over the measured lengths (decode-region pages included), times
    `kmax_serving` pages of 64 chunks, bounded by the history. Flat measured residency gives flat serving bytes."""
    import math

    from flashmemory.costmodel.bytes import EntryBytes
    from flashmemory.costmodel.flops import FlashShape

    s, e = FlashShape(), EntryBytes()
    out = []
    for ctx in lengths:
        n = ctx // s.c4_ratio
        row = {"tokens": ctx, "full_gib": s.n_c4 * n * e.kv / 2**30}
        for key in ("fm", "mon"):
            ratio = max(r[f"{key}_pages_mean"] / r["kmax"] for r in rows)
            chunks = min(n, math.ceil(ratio * kmax_serving) * 64)
            row[f"{key}_gib"] = s.n_c4 * chunks * e.kv / 2**30
        out.append(row)
    return out


def residency_table(rows: list[dict], ext: list[dict]) -> str:
    lines = [
        "| tokens | pages | FlashMemory pages (mean / max) | +monitor pages (mean / max) | miss mass (mean) | "
        "escalations | fallbacks |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['pages']} | {r['fm_pages_mean']:.2f} / {r['fm_pages_max']} | "
            f"{r['mon_pages_mean']:.2f} / {r['mon_pages_max']} | {r['miss_mass_mean']:.3f} | "
            f"{r['escalations']} | {r['fallbacks']} |"
        )
    lines += ["", "| tokens (cost model) | Full c4 KV GiB | FlashMemory GiB | +monitor GiB |", "|---:|---:|---:|---:|"]
    for r in ext:
        lines.append(f"| {r['tokens']} | {r['full_gib']:.3f} | {r['fm_gib']:.3f} | {r['mon_gib']:.3f} |")
    return "\n".join(lines)
