import json

import pytest
import torch

from flashmemory.hf import HFEngine, load_model, shipped_configs
from flashmemory.hf.capture import indexer_modules
from flashmemory.hf.layers import layer_counts


def _states_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_shipped_names():
    assert {"micro", "tiny-flash"} <= set(shipped_configs())


def test_build_is_deterministic_and_seeded():
    before = torch.random.get_rng_state()
    a, _ = load_model("micro", seed=0)
    b, _ = load_model("micro", seed=0)
    c, _ = load_model("micro", seed=1)
    assert torch.equal(before, torch.random.get_rng_state()), "building must not consume the global RNG"
    assert _states_equal(a, b)
    assert not _states_equal(a, c)


def test_hash_routing_uses_distinct_experts(micro):
    model, config, _ = micro
    gate = model.model.layers[0].mlp.gate
    t = gate.tid2eid
    assert t.shape == (config.vocab_size, config.num_experts_per_tok)
    assert (t.sort(dim=-1).values.diff(dim=-1) > 0).all(), "a token routed to the same expert twice"
    assert int(t.min()) >= 0 and int(t.max()) < config.n_routed_experts
    assert len(torch.unique(t[:, 0])) == config.n_routed_experts


def test_tiny_flash_has_21_c4_layers():
    model, config = load_model("tiny-flash")
    assert config.num_hidden_layers == 43
    assert layer_counts(config) == {"swa": 2, "c4": 21, "c128": 20}
    assert len(indexer_modules(model, config)) == 21
    engine = HFEngine(model, config)
    assert engine.n_c4_layers == 21 and engine.ratio == 4
    assert engine.index_n_heads >= 16


def test_unknown_name_and_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="micro"):
        load_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_json_config_path_and_bad_model_type(tmp_path):
    from flashmemory.hf.models import config_dict

    p = tmp_path / "m.json"
    p.write_text(json.dumps(config_dict("micro")))
    a, _ = load_model(str(p), seed=0)
    b, _ = load_model("micro", seed=0)
    assert _states_equal(a, b)
    bad = dict(config_dict("micro"), model_type="llama")
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="llama"):
        load_model(str(p))


def test_checkpoint_directory_round_trip(micro, micro_ids, tmp_path):
    model, _, engine = micro
    model.save_pretrained(tmp_path)
    loaded, cfg = load_model(str(tmp_path))
    assert cfg.layer_types == model.config.layer_types
    ids = micro_ids[:64]
    # Same weights, same forward on the same machine: the same bits, so every top-k resolves alike and equality holds.
    assert torch.equal(HFEngine(loaded, cfg).forward(ids).logits, engine.forward(ids).logits)
