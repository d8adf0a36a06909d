"""The guard's failure exchange across tensor-parallel ranks: a request that failed on one rank must fail on every
rank that runs its batch, or their schedulers would run different batches and the next collective would hang.

`tp_exchange()` builds it for this server (sglang's TP group, or under attention data parallelism its attention-TP
group: `core_config.batch_group`); `gloo_exchange` is the exchange itself over any gloo group, which the tests
drive with plain torch.distributed processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def gloo_exchange(group: Any, world: int) -> Callable[[list[tuple[str, str, str]]], list[tuple[int, str, str, str]]]:
    """The failure exchange over a torch.distributed (gloo) group of `world` ranks: every rank must call it for the
    same batch. One int64 all-reduce of the number of new failures; an all-gather of the rows only if it is > 0."""
    import torch
    import torch.distributed as dist

    def exchange(mine: list[tuple[str, str, str]]) -> list[tuple[int, str, str, str]]:
        n = torch.tensor([len(mine)], dtype=torch.int64)
        dist.all_reduce(n, group=group)
        if int(n.item()) == 0:
            return []
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, list(mine), group=group)
        return [(r, *f) for r, fs in enumerate(rows) for f in fs]

    return exchange


def tp_exchange() -> tuple[Any, int]:
    """(exchange over the cpu group of the ranks that run this batch, this process's TP rank), or (None, 0) with
    one such rank or outside a server. The group is `core_config.batch_group`: the TP group, or under attention
    DP the attention-TP group only (another DP rank's requests are not this batch's, and it runs other batches)."""
    from flashmemory.sglang.decode.core_config import batch_group

    group = batch_group()
    if group is None or group.world_size <= 1:
        return None, 0
    try:
        from sglang.srt.distributed import get_tp_group

        rank = int(get_tp_group().rank_in_group)  # the injector's rank= names a TP rank
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        rank = int(group.rank_in_group)
    return gloo_exchange(group.cpu_group, group.world_size), rank
