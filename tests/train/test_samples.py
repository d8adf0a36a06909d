"""Sampling: causality (the fix over upstream), negatives, caps and weights."""

from __future__ import annotations

import torch

from flashmemory.dump.format import list_docs, load_doc
from flashmemory.train.data_config import load_data_config
from flashmemory.train.dataset import SampleDataset, collate, resolve_docs
from flashmemory.train.samples import SampleConfig, doc_targets, draw_sample, positive_weights


def _docs(synth):
    return [load_doc(p) for p in list_docs(synth / "train")]


def test_no_sampled_chunk_exists_after_t(synth) -> None:
    cfg = SampleConfig(neg_ratio=4.0)
    seen_cut = 0
    for doc in _docs(synth):
        tg = doc_targets(doc, cfg)
        n_at = doc.n_chunks_at
        assert tg.rows.numel() > 0
        for t in tg.rows.tolist():
            ids, target, _ = draw_sample(tg, t, cfg, torch.Generator().manual_seed(t))
            assert int(ids.max()) < int(n_at[t])
            assert ids.unique().numel() == ids.numel()
            pos, _ = tg.union.row(t)
            assert torch.equal(ids[target > 0].sort().values, pos.long())  # all positives (< max_pos here)
            assert not torch.isin(ids[target == 0], pos.long()).any()
            # Labels of later steps inside the window may name chunks created after t: they are dropped.
            a, b = int(doc.label_pointers[t]), int(doc.label_pointers[min(t + 64, doc.n_tokens)])
            seen_cut += int((doc.label_indices[a:b] >= n_at[t]).sum())
    assert seen_cut > 0  # the fixture does exercise the causal cut


def test_upstream_mode_samples_future_chunks(synth) -> None:
    """causal=False reproduces upstream: ids >= n_chunks_at[t] appear (so the causal test can fail)."""
    cfg = SampleConfig(neg_ratio=4.0, causal=False)
    doc = _docs(synth)[0]
    tg = doc_targets(doc, cfg)
    over = 0
    for t in tg.rows.tolist():
        ids, _, _ = draw_sample(tg, t, cfg, torch.Generator().manual_seed(t))
        over += int((ids >= doc.n_chunks_at[t]).sum())
    assert over > 0


def test_max_pos_and_neg_ratio(synth) -> None:
    doc = _docs(synth)[0]
    cfg = SampleConfig(max_pos=3, neg_ratio=2.0)
    tg = doc_targets(doc, cfg)
    t = int(tg.rows[0])
    n_union = tg.union.row(t)[0].numel()
    ids, target, _ = draw_sample(tg, t, cfg, torch.Generator().manual_seed(0))
    assert int(target.sum()) == min(3, n_union)
    assert int((target == 0).sum()) == min(2 * int(target.sum()), int(tg.n_avail[t]) - n_union)


def test_positive_weights() -> None:
    cfg = SampleConfig(weighted=True)
    votes = torch.tensor([1, 3, 12, 21, 30], dtype=torch.int32)
    ids = torch.arange(5)
    freq = torch.tensor([False, False, False, False, True])
    w = positive_weights(votes, ids, freq, cfg)
    assert torch.allclose(w, torch.tensor([0.5, 0.5, 1.25, 2.0, 0.5]))
    assert torch.equal(positive_weights(votes, ids, freq, SampleConfig()), torch.tensor([1.0, 1, 1, 1, 0.5]))


def test_dataset_is_deterministic_per_epoch_and_collates(synth) -> None:
    paths = resolve_docs(load_data_config(synth / "data.json").train)
    ds = SampleDataset(paths, (0, 1), SampleConfig(neg_ratio=2.0), seed=1)
    a, b = ds[5], ds[5]
    assert torch.equal(a["ids"], b["ids"])
    ds.set_epoch(1)
    assert not torch.equal(ds[5]["ids"], a["ids"]) or ds[5]["ids"].numel() == 0
    batch = collate([ds[i] for i in range(4)])
    n = max(ds[i]["ids"].numel() for i in range(4))
    assert batch["keys"][0].shape == (4, n, 32) and batch["mask"].sum() == sum(ds[i]["ids"].numel() for i in range(4))
    assert bool((batch["ids"][batch["mask"]] < batch["n_avail"].repeat_interleave(batch["mask"].sum(1))).all())
