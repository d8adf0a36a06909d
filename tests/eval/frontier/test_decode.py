"""The shared-prefix decoder of the frontier sweep equals the full teacher-forced forward on the decode rows,
for every resident set and however often it is reused; one real document end to end on the micro model."""

from __future__ import annotations

import pytest
import torch

from flashmemory.eval.frontier.decode import PrefixDecoder, cached_full_run


@pytest.fixture(scope="module")
def engine():
    from flashmemory.hf import HFEngine

    return HFEngine.from_name("micro", seed=0)


def test_decoder_matches_the_full_forward_per_resident_set(engine):
    g = torch.Generator().manual_seed(0)
    P, T = 72, 6
    ids = torch.randint(2, engine.vocab_size, (P + T,), generator=g).tolist()
    dec = PrefixDecoder(engine, ids[:P])
    n = engine.n_compressed(P + T)
    for trial in range(3):  # the same decoder reused: each forward starts from the clean prompt cache
        res = torch.ones(P + T, n, dtype=torch.bool)
        res[P:] = torch.rand(T, n, generator=g) < (0.3 + 0.3 * trial)
        got = dec.forward(ids, resident=res).logits[P:]
        want = engine.forward(ids, resident=res, capture_layers=[]).logits[P:]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (trial, float((got - want).abs().max()))
    assert dec.forced_forwards == 3


def test_decoder_refuses_a_restricted_prompt_row(engine):
    ids = list(range(2, 2 + 40))
    dec = PrefixDecoder(engine, ids[:36])
    res = torch.ones(40, engine.n_compressed(40), dtype=torch.bool)
    res[3, 0] = False
    with pytest.raises(ValueError, match="prompt rows"):
        dec.forward(ids, resident=res)
    with pytest.raises(ValueError, match="extend the prefilled prompt"):
        dec.forward([5] + ids[1:], resident=None)


def test_cached_full_run_generates_full_attentions_tokens(engine):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, engine.vocab_size, (64,), generator=g).tolist()
    run, dec = cached_full_run(engine, "x", prompt, 5, (1, 2), min_layers=2)
    assert run.response_ids == engine.generate(prompt, 5)
    assert run.logits.shape[0] == 64 + 5 and run.index_chunks.shape[1] == (64 + 5) // 4


def test_batched_decode_matches_one_forward_per_set_and_decodes_equal_sets_once(engine):
    g = torch.Generator().manual_seed(2)
    P, T = 72, 6
    ids = torch.randint(2, engine.vocab_size, (P + T,), generator=g).tolist()
    dec = PrefixDecoder(engine, ids[:P])
    n = engine.n_compressed(P + T)
    sets = []
    for p in (0.2, 0.5, 0.8):
        r = torch.ones(P + T, n, dtype=torch.bool)
        r[P:] = torch.rand(T, n, generator=g) < p
        sets.append(r)
    sets.append(sets[0].clone())  # an equal set, given again
    got = dec.forward_many(ids, sets, batch=2)  # two batches: the distinct sets do not fit in one
    assert dec.forced_forwards == 4 and len(got) == 4
    assert torch.equal(got[0], got[3])
    for r, rows in zip(sets, got):
        want = dec.forward(ids, resident=r).logits[P:]
        assert torch.allclose(rows, want, atol=1e-4, rtol=1e-4), float((rows - want).abs().max())
    assert not torch.allclose(got[0], got[2], atol=1e-3)  # the sets differ, and so do their logits


def test_served_logits_are_looked_up_by_the_sets_content():
    from flashmemory.eval.frontier.decode import ServedLogits

    a = torch.ones(6, 2, dtype=torch.bool)
    b = a.clone()
    b[5, 1] = False
    served = ServedLogits(16, 4, [a, b], [torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
    assert float(served.forward(None, resident=b.clone()).logits[4:].mean()) == 2.0
    got = served.forward(None, resident=a.clone()).logits
    assert got.shape == (6, 3) and float(got[:4].abs().sum()) == 0.0 and float(got[4:].mean()) == 1.0
    c = a.clone()
    c[4, 0] = False
    with pytest.raises(KeyError):
        served.forward(None, resident=c)


def test_sweep_record_batched_equals_the_plain_harness_path(tmp_path):
    """One real document of the shipped trained model, short, at budgets whose sets differ: the batched path's
    record equals the one-forward-per-method path's (wall-time shares aside)."""
    from flashmemory.eval.frontier.run import FrontierConfig, Sweep
    from flashmemory.tiny.shipped import trained_model_available

    ck = "docs/quality/frontier_retriever.safetensors"
    if not trained_model_available():
        pytest.skip("the shipped trained model is not installed")
    fc = FrontierConfig(out_dir=str(tmp_path), retriever=ck, doc_len=512, gen_tokens=6, tau=2, budgets=(0.1, 0.3, 1.0))
    sw = Sweep(fc)
    plain, batched = sw.doc(9, "niah_single", batched=False), sw.doc(9, "niah_single", batched=True)
    assert plain.keys() == batched.keys() and plain["forced_forwards"] == batched["forced_forwards"] == 12
    assert list(plain["budgets"]) == list(batched["budgets"]) == ["0.1", "0.3", "1"]
    for b, rows in plain["budgets"].items():
        assert list(rows) == list(batched["budgets"][b])
        for name, m in rows.items():
            got = batched["budgets"][b][name]
            assert list(m) == list(got), (b, name)  # same keys in the same order: the record format
            for k, v in m.items():
                if k == "level1_share":
                    continue  # wall-time shares differ run to run
                if isinstance(v, float):
                    assert v == pytest.approx(got[k], rel=1e-6, abs=1e-9, nan_ok=True), (b, name, k)
                else:
                    assert v == got[k], (b, name, k)
