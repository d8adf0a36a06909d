"""The shared-prefix decoder of the frontier sweep equals the full teacher-forced forward on the decode rows,
for every resident set and however often it is reused; one real document end to end on the micro model."""

from __future__ import annotations

import pytest
import torch

from flashmemory.eval.frontier_decode import PrefixDecoder, cached_full_run


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
    for trial in range(3):            # the same decoder reused: each forward starts from the clean prompt cache
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
