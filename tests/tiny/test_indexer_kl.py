import torch

from flashmemory.hf.models import load_model
from flashmemory.tiny.attention import use_band_attention
from flashmemory.tiny.indexer_kl import IndexerKL, indexer_kl


def test_kl_is_zero_at_the_target_and_positive_elsewhere():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 12, 3, generator=g)
    vis = torch.arange(3).view(1, -1) < ((torch.arange(12) + 1) // 4).view(-1, 1)
    target = torch.softmax(scores.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0) * 5.0  # unnormalised
    assert indexer_kl(scores, target, 4).abs().item() < 1e-6
    assert indexer_kl(torch.randn(2, 12, 3, generator=g), target, 4).item() > 1e-3


def test_kl_ignores_future_entries_and_empty_rows():
    scores = torch.zeros(1, 8, 2)
    target = torch.zeros(1, 8, 2)
    target[0, 7, 1] = 1.0  # row 7 sees entries 0 and 1
    target[0, 3, 1] = 9.0  # row 3 sees only entry 0: this future mass is ignored, the row has no mass
    assert abs(indexer_kl(scores, target, 4).item() - torch.log(torch.tensor(2.0)).item()) < 1e-6


def test_kl_trains_only_the_indexer():
    model, config = load_model("dsv4-retrieval", seed=0)
    use_band_attention(model)
    model.train()
    ids = torch.randint(0, 900, (1, 96))
    with IndexerKL(model, config) as kl:
        model(input_ids=ids, use_cache=False)
        loss = kl.loss()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(".indexer." in n for n in grads), sorted(grads)[:5]
    assert any("weights_proj" in n for n in grads) and any("indexer.kv_proj" in n for n in grads)
