"""Distributed data parallel plumbing for `flashmemory train` under torchrun.

gloo on CPU, NCCL on CUDA. Rank 0 validates and writes files; the early-stop decision is made on
rank 0 and broadcast so every rank leaves the loop at the same step (otherwise the others would
hang in the next all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: str | torch.device) -> DistInfo:
    """Join the torchrun process group if launched by torchrun (env://), else run single-process.

    On CUDA each rank takes GPU rank % device_count.
    """
    dev = torch.device(device)
    if not dist.is_available() or not dist.is_torchelastic_launched():
        return DistInfo(0, 1, dev)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(dev), timeout=timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    return DistInfo(rank, world, dev)


def broadcast_flag(flag: bool, info: DistInfo) -> bool:
    """Rank 0's value of `flag` on every rank."""
    if not info.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=info.device if info.device.type == "cuda" else "cpu")
    dist.broadcast(t, src=0)
    return bool(t.item())


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
