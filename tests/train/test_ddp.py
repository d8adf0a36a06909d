"""Two gloo processes on halves of a fixed batch give the single-process gradient of the whole batch."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.train.setup import LogitsHead, TrainConfig, batch_loss

DIMS = RetrieverDims(hidden=32, rank=16, n_heads=4, head_dim=16, rope_dim=8)
CFG = TrainConfig(data_config="-", focal_loss=True, pairwise=0.5)


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    b, n = 6, 9
    lengths = torch.tensor([9, 4, 7, 2, 9, 5])  # ragged rows: padding must not matter
    mask = torch.arange(n).unsqueeze(0) < lengths.unsqueeze(1)
    return {
        "hidden": {L: torch.randn(b, 32, generator=g) for L in (0, 1)},
        "positions": torch.randint(0, 5000, (b,), generator=g),
        "keys": {L: torch.randn(b, n, 16, generator=g) * mask.unsqueeze(-1) for L in (0, 1)},
        "target": (torch.rand(b, n, generator=g) > 0.6).float() * mask,
        "weight": torch.rand(b, n, generator=g) + 0.5,
        "mask": mask,
    }


def _half(batch: dict, rank: int) -> dict:
    sl = slice(3 * rank, 3 * rank + 3)
    return {k: ({L: x[sl] for L, x in v.items()} if isinstance(v, dict) else v[sl]) for k, v in batch.items()}


def _model() -> JointRetriever:
    torch.manual_seed(0)
    return JointRetriever((0, 1), DIMS)


def _worker(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model()
        head = nn.parallel.DistributedDataParallel(LogitsHead(model))
        batch_loss(head, _half(_batch(), rank), CFG, torch.device("cpu")).backward()
        out[rank] = {k: p.grad.clone() for k, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gradients_equal_single_process() -> None:
    model = _model()
    batch_loss(LogitsHead(model), _batch(), CFG, torch.device("cpu")).backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    with mp.Manager() as mgr:
        out = mgr.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
        got = dict(out)
    for rank in (0, 1):
        for k, g in want.items():
            assert torch.allclose(got[rank][k], g, rtol=1e-5, atol=1e-7), (rank, k)
    # Sanity: one half alone does not give the full-batch gradient (the test can fail).
    single = _model()
    batch_loss(LogitsHead(single), _half(_batch(), 0), CFG, torch.device("cpu")).backward()
    assert not torch.allclose(single.retrievers["l0"].wq_b.weight.grad, want["retrievers.l0.wq_b.weight"], atol=1e-6)
