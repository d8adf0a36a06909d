import pytest
import torch

from flashmemory.hf import stored_index_keys, unstored_index_keys
from flashmemory.retriever.fp8 import dequantize_chunks
from flashmemory.retriever.hadamard import hadamard_transform
from tests.pinned_topk import PinnedTopk
from tests.topk_ties import greedy_agreement

# Score tolerance of top-k checks between two code paths of the same model (full forward vs cached decode): they
# differ by rounding only, about 1e-6 of the scores' scale.
RTOL, ATOL = 1e-5, 1e-6


def _mask(n: int, frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) < frac


def test_all_resident_is_the_unmodified_model(micro, micro_ids):
    model, _, engine = micro
    with torch.no_grad():
        ref = model(input_ids=micro_ids[None]).logits[0]
    # Same bits on all three: the same cacheless forward, the engine's hooks only mask nothing (masked_fill with an
    # all-False mask), so every top-k sees identical scores and exact equality holds on any machine.
    plain = engine.forward(micro_ids)
    full = engine.forward(micro_ids, resident=torch.ones(micro_ids.shape[0] // 4, dtype=torch.bool))
    assert full.logits.shape == (micro_ids.shape[0], engine.vocab_size) and full.logits.dtype == torch.float32
    assert torch.equal(plain.logits, ref)
    assert torch.equal(full.logits, ref)
    for cid in plain.topk:
        assert torch.equal(full.topk[cid], plain.topk[cid])


def _check_picks(cap, resident_rows, engine, s):
    """Every valid pick is causal and resident; invalid picks are -1; as many valid picks as allowed."""
    t = torch.arange(s).unsqueeze(1)
    n_c = s // 4
    allowed = (torch.arange(n_c).unsqueeze(0) < (t + 1) // 4) & resident_rows[:, :n_c]
    for cid, picks in cap.topk.items():
        valid = picks >= 0
        assert (picks[~valid] == -1).all()
        rows = t.expand_as(picks)[valid]
        assert allowed[rows, picks[valid]].all(), f"c4 layer {cid} attends a non-resident or future entry"
        assert torch.equal(valid.sum(1), allowed.sum(1).clamp(max=engine.index_topk))


def test_partial_mask_never_picks_non_resident(micro, micro_ids):
    _, _, engine = micro
    s = micro_ids.shape[0]
    res = _mask(s // 4, 0.25, 0)
    cap = engine.forward(micro_ids, resident=res)
    _check_picks(cap, res.unsqueeze(0).expand(s, -1), engine, s)
    # Fewer than k resident entries for many rows: those rows must carry -1 picks.
    assert (cap.topk[0] == -1).any(dim=1)[-1]
    # index_logits stay native: the first c4 layer's inputs do not depend on the mask.
    assert torch.equal(cap.index_logits[0], engine.forward(micro_ids).index_logits[0])


def test_per_query_mask(micro, micro_ids):
    _, _, engine = micro
    s = micro_ids.shape[0]
    g = torch.Generator().manual_seed(5)
    res = torch.rand(s, s // 4, generator=g) < 0.4
    cap = engine.forward(micro_ids, resident=res)
    _check_picks(cap, res, engine, s)


def test_non_resident_entries_do_not_influence_logits(micro, micro_ids):
    """Corrupting the main CSA compressed KV of non-resident entries must leave logits bit-identical."""
    model, _, engine = micro
    s = micro_ids.shape[0]
    res = _mask(s // 4, 0.5, 1)

    def corrupt(which):
        def hook(module, args, out):
            kv, bias = out
            kv = kv.clone()
            kv[:, :, which[: kv.shape[2]]] += 50.0
            return kv, bias

        return [model.model.layers[li].self_attn.compressor.register_forward_hook(hook) for li in engine.c4_layers]

    base = engine.forward(micro_ids, resident=res).logits
    for which, should_change in ((~res, False), (res, True)):
        handles = corrupt(which)
        try:
            got = engine.forward(micro_ids, resident=res).logits
        finally:
            for h in handles:
                h.remove()
        assert torch.equal(got, base) != should_change


@pytest.mark.parametrize("masked", [False, True])
def test_prefill_decode_parity(micro, micro_ids, masked):
    _, _, engine = micro
    ids = micro_ids[:150]
    res = _mask(150 // 4, 0.5, 2) if masked else None
    pin = PinnedTopk(engine.model, rtol=RTOL, atol=ATOL)  # decode's indexer and gate picks: the full forward's
    with pin.record():
        full = engine.forward(ids, resident=res).logits
    with pin.replay():
        inc = engine.incremental_logits(ids, prefill_len=100, resident=res)
    assert inc.shape == full.shape
    torch.testing.assert_close(inc, full, rtol=0, atol=1e-4)


def _tie_at(engine, pos: int, side: str, ref_picks=None):
    """Hook on the first c4 indexer's scorer: at query position `pos`, put its 17th score one ulp below its 16th
    (`side` "below": the 16th stays picked), or make it pick what the reference did not (`ref_picks` [k]: the
    reference's picks there): the reference's lowest pick loses to the best other entry, set one ulp above it
    ("above": a near-tie) or 1e-3 above it ("far": a real difference). The flip is built from the reference's
    picks, not from this side's own order, so it holds whichever way this CPU rounds a near-tie. Works on full
    forwards and on cached decode steps."""
    from tests.topk_ties import flip_against, flip_boundary

    indexer = engine.model.model.layers[engine.c4_layers[0]].self_attn.compressor.indexer
    seen = {}

    def pre(module, args, kwargs):
        seen["start"] = int(kwargs.get("position_ids", args[2] if len(args) > 2 else None).reshape(-1)[0])

    def hook(module, args, out):
        row = pos - seen["start"]
        if not 0 <= row < out.shape[1]:
            return None
        out = out.clone()
        n = (pos + 1) // 4
        if side == "below":
            flipped, up, down, _ = flip_boundary(out[0, row, :n], engine.index_topk)
            flipped[up] = torch.nextafter(flipped[down], torch.tensor(float("-inf")))
        else:
            flipped, up, down, _ = flip_against(out[0, row, :n], ref_picks)
            if side == "far":
                flipped[up] = flipped[down] + 1e-3
        out[0, row, :n] = flipped
        return out

    return [indexer.register_forward_pre_hook(pre, with_kwargs=True), indexer.scorer.register_forward_hook(hook)]


@pytest.mark.parametrize("side", ["above", "far"])
def test_prefill_decode_parity_survives_a_near_tie_only(micro, micro_ids, side):
    """Decode step 130: the full forward's 17th indexer score sits one ulp below its 16th; decode's sits one ulp
    above (the pick flips: a near-tie, accepted and pinned, logits still equal) or 1e-3 above (fails)."""
    _, _, engine = micro
    ids = micro_ids[:150]
    pin = PinnedTopk(engine.model, rtol=RTOL, atol=ATOL)
    hooks = _tie_at(engine, 130, "below")
    with pin.record():
        full = engine.forward(ids).logits
    for h in hooks:
        h.remove()
    name = f"model.layers.{engine.c4_layers[0]}.self_attn.compressor.indexer"
    hooks = _tie_at(engine, 130, side, ref_picks=pin.ref[name][1][0, 130])
    try:
        if side == "far":
            with pytest.raises(AssertionError, match="positions 130..130"):
                with pin.replay():
                    engine.incremental_logits(ids, prefill_len=100)
            return
        with pin.replay():
            inc = engine.incremental_logits(ids, prefill_len=100)
    finally:
        for h in hooks:
            h.remove()
    assert pin.near_ties == 1
    torch.testing.assert_close(inc, full, rtol=0, atol=1e-4)


def test_generate_matches_greedy_full_forwards(micro, micro_ids):
    _, _, engine = micro
    prompt = micro_ids[:90].tolist()
    n_new = 6
    res = _mask((90 + n_new) // 4, 0.5, 3)
    for r in (None, res):
        gen, agreed = _generate_vs_full_forwards(engine, prompt, n_new, r)
        assert agreed == n_new  # every top-1 margin here is >= 2.4e-3, 300x the logits' tolerance: no near-tie
    assert engine.generate(prompt, 0) == []


def _generate_vs_full_forwards(engine, prompt: list[int], n_new: int, resident, nudge=None) -> tuple[list[int], int]:
    """`generate`'s tokens against the greedy loop of full forwards, robust to near-ties on either side.

    generate (prefill + cached decode) records every indexer's and gate's top-k; the full forward over the prompt
    and the generated tokens but the last (teacher-forced: by causality its row t is the last row of the loop's full
    forward of that prefix, up to rounding) replays them,
    checked to be the same picks up to near-ties; then each generated token must be that forward's argmax, up to
    a step where it is within the logits' tolerance of it (a near-tie, after which the two greedy continuations
    are different prompts). `nudge(logits)` may edit the full forward's logits. Returns (tokens, agreed steps)."""
    pin = PinnedTopk(engine.model, rtol=RTOL, atol=ATOL)
    with pin.record():
        gen = engine.generate(prompt, n_new, resident=resident)
    with pin.replay():
        logits = engine.forward(prompt + gen[:-1], resident=resident).logits[len(prompt) - 1 :]  # [n_new, V]
    if nudge is not None:
        logits = nudge(logits)
    n, why = greedy_agreement(logits, gen, rtol=RTOL, atol=ATOL)
    assert why in ("", "near-tie"), why
    return gen, n


def test_generate_comparison_stops_at_a_near_tie_and_fails_beyond_it(micro, micro_ids):
    """A one-ulp flip of step 3's top two logits on the full-forward side is a near-tie (comparison stops there);
    moving the runner-up 1.0 above the top is a real difference and fails."""
    from tests.topk_ties import flip_boundary

    _, _, engine = micro
    prompt = micro_ids[:90].tolist()

    def flip(delta: float):
        def nudge(logits):
            logits = logits.clone()
            logits[3], up, _, _ = flip_boundary(logits[3], 1)
            logits[3, up] += delta
            return logits

        return nudge

    _, agreed = _generate_vs_full_forwards(engine, prompt, 6, None, nudge=flip(0.0))
    assert agreed == 3
    with pytest.raises(AssertionError, match="step 3: token"):
        _generate_vs_full_forwards(engine, prompt, 6, None, nudge=flip(1.0))


def test_generate_stops_at_eos(micro, micro_ids):
    _, _, engine = micro
    prompt = micro_ids[:40].tolist()
    out = engine.generate(prompt, 5)
    assert engine.generate(prompt, 5, eos_token_id=out[1]) == out[: out.index(out[1]) + 1]


def test_bad_inputs(micro, micro_ids):
    _, _, engine = micro
    with pytest.raises(ValueError, match="token ids"):
        engine.forward([5, 1024])
    with pytest.raises(ValueError, match="non-empty"):
        engine.forward([])
    with pytest.raises(ValueError, match="bool"):
        engine.forward(micro_ids[:40], resident=torch.ones(10))
    with pytest.raises(ValueError, match=r"N_c>=10"):
        engine.forward(micro_ids[:40], resident=torch.ones(9, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[40, N_c>=10\]"):
        engine.forward(micro_ids[:40], resident=torch.ones(39, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="capture_layers"):
        engine.forward(micro_ids[:40], capture_layers=[4])
    with pytest.raises(ValueError, match=r"N_c>=12"):
        engine.generate(micro_ids[:40].tolist(), 9, resident=torch.ones(11, dtype=torch.bool))


def test_short_sequence_has_no_entries(micro):
    _, _, engine = micro
    cap = engine.forward([7, 8, 9])
    assert cap.index_logits[0].shape == (3, 0) and cap.index_keys[0].shape == (0, engine.index_head_dim)
    assert (cap.topk[0] == -1).all() and cap.topk[0].shape == (3, engine.index_topk)


def test_stored_index_keys_round_trip(micro, micro_ids):
    _, _, engine = micro
    keys = engine.forward(micro_ids, capture_layers=[2]).index_keys[2]
    chunks = stored_index_keys(keys)
    d = engine.index_head_dim
    assert chunks.dtype == torch.uint8 and chunks.shape == (keys.shape[0], d + 4)
    rotated = hadamard_transform(keys)
    # The stored values are the rotated keys (not the raw ones), to fp8 precision.
    stored = dequantize_chunks(chunks)
    amax = rotated.abs().amax(dim=1, keepdim=True)
    assert ((stored - rotated).abs() <= amax / 16 + 1e-6).all()
    back = unstored_index_keys(chunks)
    rel = (back - keys).norm(dim=1) / keys.norm(dim=1)
    assert rel.max() < 0.07, rel.max()
    assert not torch.allclose(stored, keys, atol=1e-3)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        stored_index_keys(keys[0])


def test_thread_count_is_restored(micro, micro_ids):
    from flashmemory.hf.engine import HFEngine, torch_threads

    model, config, _ = micro
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = HFEngine(model, config, num_threads=1, decode_threads=1)
        engine.generate(micro_ids[:20].tolist(), 2)
        engine.forward(micro_ids[:20])
        assert torch.get_num_threads() == 2
        with torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match=">= 1"):
            with torch_threads(0):
                pass
    finally:
        torch.set_num_threads(old)
