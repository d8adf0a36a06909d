import pytest
import torch
from transformers.cache_utils import DynamicCache

from flashmemory.hf.capture import IndexerHooks, indexer_modules, not_resident
from tests.pinned_topk import PinnedTopk


def _n_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_are_removed_even_on_error(micro, micro_ids):
    model, config, _ = micro
    assert _n_hooks(model) == 0
    with pytest.raises(ValueError, match="resident mask covers"):
        with IndexerHooks(model, config, resident=torch.ones(3, dtype=torch.bool)):
            model(input_ids=micro_ids[None, :64], use_cache=False)
    assert _n_hooks(model) == 0


def test_index_logits_causal_pattern(micro, micro_ids):
    _, _, engine = micro
    cap = engine.forward(micro_ids)
    s = micro_ids.shape[0]
    n_c = s // 4
    t = torch.arange(s).unsqueeze(1)
    j = torch.arange(n_c).unsqueeze(0)
    hidden_mask = j >= (t + 1) // 4
    assert sorted(cap.index_logits) == list(range(engine.n_c4_layers))
    for cid, lg in cap.index_logits.items():
        assert lg.shape == (s, n_c) and lg.dtype == torch.float32
        assert torch.equal(torch.isneginf(lg), hidden_mask), f"c4 layer {cid}"
        assert torch.isfinite(lg[~hidden_mask]).all()


def test_topk_is_top_of_index_logits(micro, micro_ids):
    _, _, engine = micro
    cap = engine.forward(micro_ids)
    k = engine.index_topk
    for cid, lg in cap.index_logits.items():
        picks = cap.topk[cid]
        assert picks.shape == (lg.shape[0], k) and picks.dtype == torch.int64
        n_visible = torch.isfinite(lg).sum(dim=1)
        n_valid = (picks >= 0).sum(dim=1)
        assert torch.equal(n_valid, n_visible.clamp(max=k))
        # Valid picks first (descending score), then -1; their scores are the row's top values.
        for t in range(0, lg.shape[0], 7):
            nv = int(n_valid[t])
            assert (picks[t, nv:] == -1).all()
            got = lg[t, picks[t, :nv]]
            assert torch.equal(got, lg[t].topk(nv).values)


def test_hidden_is_attention_input(micro, micro_ids):
    model, config, engine = micro
    seen = {}
    handles = [
        model.model.layers[li].self_attn.register_forward_pre_hook(
            lambda m, a, kw, li=li: seen.__setitem__(li, kw.get("hidden_states", a[0] if a else None)), with_kwargs=True
        )
        for li in engine.c4_layers
    ]
    try:
        cap = engine.forward(micro_ids, capture_layers=[1, 3])
    finally:
        for h in handles:
            h.remove()
    assert sorted(cap.hidden) == [1, 3] and sorted(cap.index_keys) == [1, 3]
    assert sorted(cap.topk) == list(range(engine.n_c4_layers))
    for cid in (1, 3):
        assert cap.hidden[cid].shape == (micro_ids.shape[0], engine.hidden_size)
        assert torch.equal(cap.hidden[cid], seen[engine.c4_layers[cid]][0].float())


def test_index_keys_match_cached_compressor(micro, micro_ids):
    """Prefill keys equal what the stateful (cached) indexer compressor accumulates chunk by chunk."""
    model, config, engine = micro
    ids = micro_ids[:120]
    pin = PinnedTopk(model, rtol=1e-5, atol=1e-6)  # later c4 layers' keys: the chunks on the full forward's picks
    with pin.record():
        cap = engine.forward(ids)
    cache = DynamicCache(config=config)
    with torch.no_grad(), pin.replay():
        model(input_ids=ids[None, :50], past_key_values=cache, use_cache=True)
        model(input_ids=ids[None, 50:], past_key_values=cache, use_cache=True)
    for cid, li in enumerate(engine.c4_layers):
        keys = cap.index_keys[cid]
        assert keys.shape == (120 // 4, engine.index_head_dim)
        ref = cache.layers[li].compressed_kv["indexer"][0]
        torch.testing.assert_close(keys, ref.float(), rtol=1e-5, atol=1e-5)


def test_not_resident_shapes():
    r1 = torch.tensor([True, False, True, True])
    assert torch.equal(not_resident(r1, torch.arange(2), 3), torch.tensor([[False, True, False]]))
    r2 = torch.tensor([[True, False], [False, True], [True, True]])
    assert torch.equal(not_resident(r2, torch.tensor([2, 0]), 2), torch.tensor([[False, False], [False, True]]))
    with pytest.raises(ValueError, match="rows"):
        not_resident(r2, torch.tensor([3]), 2)


def test_indexer_modules_count(micro):
    model, config, engine = micro
    assert len(indexer_modules(model, config)) == engine.n_c4_layers == 4
