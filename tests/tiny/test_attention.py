import pytest
import torch

from flashmemory.hf.models import load_model
from flashmemory.tiny.attention import band_attention, use_band_attention
from flashmemory.tiny.indexer_kl import set_index_topk


def _model(topk: int | None = None):
    model, config = load_model("dsv4-retrieval", seed=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial sinks and compressor biases, so every term of the softmax matters
        for n, p in model.named_parameters():
            if n.endswith("sinks") or "position_bias" in n:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.mul_(4.0)
    if topk is not None:
        set_index_topk(model, config, topk)
    return model, config


def _attn_outputs(model, ids):
    outs = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o: outs.append(o[0].detach().clone()))
             for layer in model.model.layers]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    for h in hooks:
        h.remove()
    return logits, outs


@pytest.mark.parametrize("topk", [None, 3])
def test_band_attention_equals_eager(topk):
    """Every layer's attention output (SWA, c4 with dense or sparse picks, c128) matches eager."""
    model, _ = _model(topk)
    ids = torch.randint(0, 900, (2, 300), generator=torch.Generator().manual_seed(1))
    ref_logits, ref = _attn_outputs(model, ids)
    use_band_attention(model)
    logits, got = _attn_outputs(model, ids)
    assert len(got) == len(ref) == 6
    for i, (a, b) in enumerate(zip(ref, got)):
        scale = a.abs().max().item()
        assert scale > 1e-3
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, scale), f"layer {i}"
    assert torch.allclose(ref_logits, logits, atol=1e-4, rtol=1e-4)


def test_band_attention_falls_back_with_a_cache():
    """Cached decode (q_len 1) takes the eager path; incremental logits equal a full forward."""
    from flashmemory.hf import HFEngine
    model, config = _model(1 << 20)
    use_band_attention(model)
    eng = HFEngine(model, config)
    ids = torch.randint(0, 900, (90,), generator=torch.Generator().manual_seed(2))
    full = eng.forward(ids).logits
    inc = eng.incremental_logits(ids, prefill_len=70)
    assert torch.allclose(full, inc, atol=1e-4, rtol=1e-4)


def test_band_attention_drop_only_in_training():
    model, _ = _model()
    attn = model.model.layers[2].self_attn  # c128
    attn._fm_drop_comp = 0.99
    use_band_attention(model)
    ids = torch.randint(0, 900, (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = model(input_ids=ids, use_cache=False).logits
        b = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(a, b)  # eval mode: no dropping, deterministic
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():
        c = model(input_ids=ids, use_cache=False).logits
    assert not torch.allclose(a, c)


def test_band_attention_rejects_nothing_it_cannot_do():
    """Shapes that are not a cacheless forward go to eager (same result as eager_attention_forward)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward
    model, _ = _model()
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 1, 128)
    k = torch.randn(1, 1, 5, 128)
    mask = torch.zeros(1, 1, 1, 5)
    a, _ = band_attention(attn, q, k, k, mask, scaling=0.1)
    b, _ = eager_attention_forward(attn, q, k, k, mask, scaling=0.1)
    assert torch.allclose(a, b)
