"""The engine replay and the quality metrics on small synthetic documents."""

import torch

from flashmemory.eval.decode import golden_recall, mass_covered, resident_stats
from flashmemory.eval.methods import MassPagePolicy, RandomPolicy, RecencyPolicy, zero_scorer
from flashmemory.eval.replay import replay_doc
from flashmemory.labels.csr import LabelsCSR
from flashmemory.retriever.fp8 import quantize_chunks


def _doc(n_layers=3, prompt=64, steps=24, d=8, hidden=16):
    n_total = (prompt + steps) // 4
    chunks = torch.stack([quantize_chunks(torch.randn(n_total, d)) for _ in range(n_layers)])
    hid = {l: torch.randn(prompt + steps, hidden) for l in range(n_layers)}
    return chunks, hid, prompt, steps, n_total


def test_full_budget_makes_everything_resident_and_bytes_match_pages():
    chunks, hid, P, T, n = _doc()
    pc = 4
    rep = replay_doc(
        chunks,
        hid,
        P,
        T,
        lambda e: (zero_scorer, RecencyPolicy(pc)),
        page_chunks=pc,
        kmax=64,
        tau=8,
        last_keep=4,
        target_layers=(1,),
    )
    for t in range(T):
        n_t = (P + t + 1) // 4
        assert rep.n_visible[t] == n_t
        assert rep.resident[t, :n_t].all(), t
        assert not rep.resident[t, n_t:].any(), "a chunk that does not exist yet is resident"
    lay = rep.layout
    per_page = lay.n_layers * lay.kv_page_bytes + len(lay.offload_index_layers) * lay.index_page_bytes
    assert rep.metrics["recall_bytes"] == rep.metrics["recall_pages"] * per_page > 0


def test_small_budget_keeps_the_newest_pages_only():
    chunks, hid, P, T, n = _doc()
    pc, kmax = 4, 2
    rep = replay_doc(
        chunks,
        hid,
        P,
        T,
        lambda e: (zero_scorer, RecencyPolicy(pc)),
        page_chunks=pc,
        kmax=kmax,
        tau=8,
        last_keep=4,
        target_layers=(1,),
    )
    n0 = (P + 1) // 4  # step 0: the cycle recalled the newest kmax pages of the prompt
    res0 = rep.resident[0, :n0].nonzero().flatten()
    assert res0.min() >= (-(-(P // 4) // pc) - kmax) * pc
    assert rep.resident.sum(1).max() <= (kmax + 2) * pc  # recalled pages plus the decode ring


def test_policies_respect_budget_and_history():
    pol = MassPagePolicy(page_chunks=4, last_keep=4)
    s = torch.zeros(30)
    s[[1, 2, 9]] = 1.0
    # the tail (chunks 26..29) spans pages 6 and 7; then page 0 (two hits) before page 2 (one)
    assert pol(s, 30, 3).tolist() == [0, 6, 7]
    assert pol(s, 30, 4).tolist() == [0, 2, 6, 7]
    assert pol(s, 30, 5).tolist() == [0, 2, 5, 6, 7]  # then the newest zero-scoring pages fill the budget
    assert pol(s, 30, 9).tolist() == list(range(8))  # every method gets the same budget (capped by history)
    rnd = RandomPolicy(page_chunks=4, last_keep=4, seed=1)(s, 30, 4)
    assert len(rnd) == 4 and rnd.max() < 8 and {6, 7} <= set(rnd.tolist()) and rnd.tolist() == sorted(rnd.tolist())


def test_quality_metrics_against_brute_force():
    torch.manual_seed(0)
    T, N, k = 5, 12, 4
    logits = torch.randn(T, N)
    resident = torch.rand(T, N) > 0.5

    class Run:  # the fields mass_covered reads
        prompt_len, n_steps = 0, T
        index_logits = {0: logits, 1: logits * 2}

    want = []
    for lg in (logits, logits * 2):
        for t in range(T):
            v, i = lg[t].topk(k)
            p = torch.softmax(v, 0)
            want.append(sum(float(p[j]) for j in range(k) if resident[t, i[j]]))
    assert abs(mass_covered(Run, resident, k) - sum(want) / len(want)) < 1e-6
    labels = LabelsCSR.from_rows([[(1, 3), (2, 3)], [], [(5, 4)], [(0, 3), (7, 3), (8, 3)], [(11, 3)]])
    rec = []
    for t, row in enumerate(labels.to_rows()):
        if row:
            rec.append(sum(bool(resident[t, c]) for c, _ in row) / len(row))
    assert abs(golden_recall(labels, resident) - sum(rec) / len(rec)) < 1e-6
    st = resident_stats(resident, torch.full((T,), N), n_c4=3, index_bytes=36, n_target=1)
    assert abs(st["resident_frac"] - resident.float().mean().item()) < 1e-6
    assert 0 < st["bytes_vs_full"] < 1
