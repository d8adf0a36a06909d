"""Quality harness: decode with a resident set enforced at Level 2 and compare with Full attention.

For each document, the Full run generates greedily (pass 1), then one teacher-forced forward over
prompt + response captures every c4 layer's native indexer logits, top-k picks, hidden states and keys
(pass 2). A method's resident sets (one per decode step, from `flashmemory.eval.replay`) are then
enforced in every c4 layer's top-k in one teacher-forced forward over the same tokens. Per method:
  - agreement: greedy next token equal to Full's, over the decode steps;
  - mass: share of Full's native top-k softmax mass (per layer, per step) inside the resident set;
  - golden recall: share of each step's golden labels inside the resident set;
  - resident fraction (of the visible chunks) and resident bytes against Full at DeepSeek-V4 entry sizes;
  - task score of the teacher-forced greedy tokens, where the task has a scorer.
Scope: on a tiny random-weight model this is a mechanics check that ranks policies and catches
regressions; it makes no claim about real long-context accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmemory.labels.csr import LabelsCSR
from flashmemory.labels.golden import golden_labels

C4_ENTRY_BYTES = 584


@dataclass
class DocRun:
    """The Full run of one document."""

    name: str
    prompt_ids: list[int]
    response_ids: list[int]
    logits: torch.Tensor  # [S, vocab] Full next-token logits
    index_logits: dict[int, torch.Tensor]  # c4 id -> [S, N_c] native logits (-inf where not visible)
    topk: dict[int, torch.Tensor]  # c4 id -> [S, k] picks (-1 invalid)
    hidden: dict[int, torch.Tensor]  # target c4 id -> [S, hidden]
    index_chunks: torch.Tensor  # [n_c4, N_c, D+4] uint8 stored index keys
    labels: LabelsCSR  # golden labels of the T decode steps
    decode_step_s: float  # measured seconds per decode step of the Full generate
    cap: object = None  # the `ForwardCapture` (for writing dump documents)
    record: dict | None = None  # the task item, when the document came from the task suite

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_steps(self) -> int:
        return len(self.response_ids)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def full_run(
    engine,
    name: str,
    prompt_ids: list[int],
    max_new_tokens: int,
    target_layers: tuple[int, ...],
    topp: float = 0.6,
    min_layers: int = 3,
    record: dict | None = None,
) -> DocRun:
    """Generate greedily under Full attention, then capture everything from one forward.

    `decode_step_s` is the mean wall time of the one-token decode forwards of that same generate, each
    timed on its own (the prefill is never among them, so it cannot be subtracted into a negative).
    """
    times: list[float] = []
    response = list(engine.generate(prompt_ids, max_new_tokens, step_times=times))
    step_s = sum(times) / len(times) if times else 0.0
    return capture_run(engine, name, prompt_ids, response, step_s, target_layers, topp, min_layers, record)


def capture_run(
    engine,
    name: str,
    prompt_ids: list[int],
    response: list[int],
    step_s: float,
    target_layers: tuple[int, ...],
    topp: float,
    min_layers: int,
    record: dict | None,
    keep_cap: bool = True,
) -> DocRun:
    """The DocRun of a finished Full-attention generate: one capture forward over prompt + response gives the
    logits, per-c4-layer index logits [S, N_c] and top-k, the hidden states of `target_layers`, the stored index
    keys (stacked [n_c4, N_c, ...]) and the golden labels of the T decode rows (top-p `topp`, at least
    `min_layers` c4 layers). step_s: the mean decode-step time of that generate; keep_cap=False drops the capture
    (the caller keeps nothing else of it)."""
    from flashmemory.hf import stored_index_keys

    ids = list(prompt_ids) + response
    cap = engine.forward(ids, capture_layers=None)
    P, T = len(prompt_ids), len(response)
    n_c4 = engine.n_c4_layers
    labels = golden_labels(
        [cap.index_logits[c][P : P + T] for c in range(n_c4)], topk=engine.index_topk, topp=topp, min_layers=min_layers
    )
    chunks = torch.stack([stored_index_keys(cap.index_keys[c]) for c in range(n_c4)])
    return DocRun(
        name,
        list(prompt_ids),
        response,
        cap.logits,
        cap.index_logits,
        cap.topk,
        {c: cap.hidden[c] for c in target_layers},
        chunks,
        labels,
        step_s,
        cap if keep_cap else None,
        record,
    )


def query_mask(run: DocRun, resident: torch.Tensor) -> torch.Tensor:
    """[S, N_c] bool per-query mask: prompt rows (prefill) see everything; decode row P + t sees resident[t]."""
    S, n = len(run.ids), run.index_chunks.shape[1]
    m = torch.ones(S, n, dtype=torch.bool)
    m[run.prompt_len : run.prompt_len + run.n_steps] = resident[:, :n]
    return m


def mass_covered(run: DocRun, resident: torch.Tensor, k: int) -> float:
    """Mean over c4 layers and decode steps of Full's top-k softmax mass that lies inside the resident set."""
    P, T = run.prompt_len, run.n_steps
    out = []
    for lg in run.index_logits.values():
        rows = lg[P : P + T]
        kk = min(k, rows.shape[1])
        vals, idx = rows.topk(kk, dim=1)
        p = torch.softmax(vals, dim=1).nan_to_num(0.0)
        out.append((p * resident.gather(1, idx).float()).sum(1).mean())
    return float(torch.stack(out).mean())


def golden_recall(labels: LabelsCSR, resident: torch.Tensor) -> float:
    """Mean over steps with a golden label of the share of that step's golden chunks that are resident."""
    rows = labels.row_ids()
    if rows.numel() == 0:
        return float("nan")
    hit = resident[rows, labels.indices.long()].float()
    n = torch.zeros(labels.n_tokens).scatter_add_(0, rows, torch.ones_like(hit))
    h = torch.zeros(labels.n_tokens).scatter_add_(0, rows, hit)
    ok = n > 0
    return float((h[ok] / n[ok]).mean())


def resident_stats(
    resident: torch.Tensor, n_vis: torch.Tensor, n_c4: int, index_bytes: int, n_target: int
) -> dict[str, float]:
    """Resident fraction, and device bytes at DeepSeek-V4 entry sizes (584-B c4 KV in every c4 layer; index-K
    resident for offloaded layers, always on device for the target layers) against Full."""
    res = resident.sum(1).float()
    frac = float((res / n_vis.clamp_min(1).float()).mean())
    per_chunk_full = n_c4 * (C4_ENTRY_BYTES + index_bytes)
    dev = res * (n_c4 * C4_ENTRY_BYTES + (n_c4 - n_target) * index_bytes) + n_vis.float() * n_target * index_bytes
    full = n_vis.float() * per_chunk_full
    return {
        "resident_frac": frac,
        "resident_kib": float(dev.mean()) / 1024,
        "full_kib": float(full.mean()) / 1024,
        "bytes_vs_full": float(dev.mean() / full.mean()),
    }


def method_quality(
    engine,
    run: DocRun,
    resident: torch.Tensor | None,
    n_vis: torch.Tensor,
    target_layers: tuple[int, ...],
    decode_text=None,
) -> dict[str, float]:
    """Metrics of one method on one document. resident None = Full attention (no forward needed)."""
    P, T = run.prompt_len, run.n_steps
    n_c4, cb = run.index_chunks.shape[0], run.index_chunks.shape[2]
    if resident is None:
        resident = torch.arange(run.index_chunks.shape[1]).view(1, -1) < n_vis.view(-1, 1)
        logits = run.logits
    else:
        logits = engine.forward(run.ids, resident=query_mask(run, resident), capture_layers=[]).logits
    pred = logits[P : P + T].argmax(-1)
    full = run.logits[P : P + T].argmax(-1)
    out = {
        "agreement": float((pred == full).float().mean()),
        "mass": mass_covered(run, resident, engine.index_topk),
        "golden_recall": golden_recall(run.labels, resident),
    }
    out |= resident_stats(resident, n_vis, n_c4, cb, len(target_layers))
    if run.record is not None and decode_text is not None:
        from flashmemory.tasks.suite import score

        # Step t predicts response token t + 1; the first response token comes from the prefill.
        toks = [run.response_ids[0]] + pred[:-1].tolist()
        out["task_score"] = float(score(run.record, decode_text(toks)))
    return out
