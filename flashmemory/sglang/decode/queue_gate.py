"""The decode waiting queue under shrink mode's disk-tier DRAM cap: hold back a request whose pages are on disk.

On a PD decode server a request whose KV transfer completed waits in the scheduler's `waiting_queue` until
`_get_new_prebuilt_batch` (sglang 0.5.23 `disaggregation/decode.py:3375`) moves the first free-slot's worth of
it into the running batch. `around_prebuilt_batch` runs around that call: it hands the queue, in order, to the
shrink adapter's `queue_gate` (which records new requests' landed pages, parks the queue's tail in the tier when
the landed pages pass SGLANG_PATHP_HOST_MIRROR_GB, and starts reading back a parked request that is next), and
takes the requests it names out of the queue for this call only: they go back to its front afterwards, so
they run as soon as their pages are in host DRAM, in their order. Gated by the `shrink_cap` feature (shrink mode
with the disk tier and the cap set); without an adapter or a cap the call is sglang's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashmemory.sglang.decode.guard import guarded
from flashmemory.sglang.decode.runtime import RUNTIME
from flashmemory.sglang.decode.tables import c4_page_table


def landed_tokens(req: Any) -> int:
    """Tokens whose KV the transfer put on this server: the prompt and every output token but the newest (the
    fill length sglang's decode preallocation uses)."""
    return len(req.origin_input_ids) + max(len(getattr(req, "output_ids", None) or ()) - 1, 0)


def pool_row(req: Any) -> int | None:
    """The request's req_to_token row (sglang 0.5.23 keeps it on `req.kv`), or None while it holds no KV."""
    idx = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    return None if idx is None else int(idx)


def table_of(req_to_token_pool: Any) -> Callable[[int, int, int], list[int]]:
    """(req_pool_idx, tokens, page_size) -> the request's c4 pool pages (`tables.c4_page_table` of its row)."""

    def pages(idx: int, tokens: int, page_size: int) -> list[int]:
        rows, lens = torch.tensor([idx]), torch.tensor([tokens])
        return c4_page_table(req_to_token_pool.req_to_token, rows, lens, page_size)[0].tolist()

    return pages


@guarded("around_prebuilt_batch", None, RUNTIME)
def around_prebuilt_batch(original: Callable, self: Any, running_batch: Any, *args: Any, **kwargs: Any) -> Any:
    engine = RUNTIME.engine
    waiting = list(getattr(self, "waiting_queue", None) or ())
    pool = getattr(self, "req_to_token_pool", None)
    if engine is None or not waiting or pool is None:
        return original(self, running_batch, *args, **kwargs)
    n_next = max(0, min(pool.size, self.max_running_requests) - running_batch.batch_size())
    rows = [(str(r.rid), pool_row(r), landed_tokens(r)) for r in waiting]
    held = engine.queue_gate([(rid, idx, n) for rid, idx, n in rows if idx is not None], n_next, table_of(pool))
    if not held:
        return original(self, running_batch, *args, **kwargs)
    back = [r for r in waiting if str(r.rid) in held]
    self.waiting_queue = [r for r in waiting if str(r.rid) not in held]
    try:
        return original(self, running_batch, *args, **kwargs)
    finally:
        self.waiting_queue = back + list(self.waiting_queue)
