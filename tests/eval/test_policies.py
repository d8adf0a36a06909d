"""Residency policies: causal masks of the right size, and what each one keeps."""

from __future__ import annotations

import torch

from flashmemory.dump.format import list_docs, load_doc
from flashmemory.eval.policies import flashmemory_mask, oracle, random_policy, reactive, recency, top_budget
from flashmemory.labels import lookahead_union


def test_policies_on_a_dump(synth) -> None:
    doc = load_doc(list_docs(synth / "train")[0])
    for t in (0, 17, doc.n_tokens - 1):
        n = int(doc.n_chunks_at[t])
        for pol in (recency, random_policy, reactive, oracle):
            m = pol(doc, t, 5)
            assert m.dtype == torch.bool and m.numel() == n
            assert int(m.sum()) <= 5
        assert recency(doc, t, 5).nonzero().squeeze(1).tolist() == list(range(n - 5, n))
        assert int(random_policy(doc, t, 5).sum()) == 5
        gold, votes = lookahead_union(doc.labels, t, 64, n)
        full = oracle(doc, t, None)
        assert torch.equal(full.nonzero().squeeze(1), gold.long())
        top = oracle(doc, t, 2).nonzero().squeeze(1)
        assert set(top.tolist()) <= set(gold.tolist()) and len(top) == min(2, len(gold))
        now, _ = doc.labels.row(t)
        assert set(reactive(doc, t, None).nonzero().squeeze(1).tolist()) == {int(i) for i in now if i < n}


def test_top_budget_and_threshold() -> None:
    s = torch.tensor([0.2, 0.9, 0.6, 0.6, 0.1])
    assert top_budget(s, 2).tolist() == [False, True, False, True, False]  # tie -> newer chunk
    assert flashmemory_mask(s, None, 0.5).tolist() == [False, True, True, True, False]
    assert flashmemory_mask(s, 1).tolist() == [False, True, False, False, False]


def test_mass_policy_fills_the_budget() -> None:
    """Oracle/Reactive (MassPagePolicy) get the same KMAX pages as every method, even when few pages score."""
    import torch

    from flashmemory.eval.methods import MassPagePolicy

    pol = MassPagePolicy(page_chunks=4, last_keep=4)
    scores = torch.zeros(40)
    scores[5] = 3.0  # one scored chunk, in page 1
    pages = pol(scores, 40, 4).tolist()
    assert len(pages) == 4
    assert 1 in pages and 9 in pages  # the scored page and the recency tail
    assert pages == [1, 7, 8, 9]  # the rest: the newest other pages
    assert pol(scores, 40, 20).tolist() == list(range(10))  # never more than exist
    scores[:] = 0.0
    assert pol(scores, 38, 3).tolist() == [7, 8, 9]
