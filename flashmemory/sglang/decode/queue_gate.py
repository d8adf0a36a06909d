"""The PD decode waiting queue: hold back the requests this decode step cannot warm-start, and (shrink mode under
the disk tier's DRAM cap) the ones whose pages are on disk.

On a PD decode server a request whose KV transfer completed waits in the scheduler's `waiting_queue` until
`_get_new_prebuilt_batch` (sglang 0.5.23 `disaggregation/decode.py:3375`, called once per scheduler iteration,
before the decode batch it merges into) moves the first free-slot's worth of it into the running batch; each of
those is admitted by the adapter at its first decode step, and its warm start copies up to KMAX - 1 pages x 21
layers into the reserve on that step. `around_prebuilt_batch` runs around that call and takes requests out of the
queue for the call only; they go back afterwards in their queue order, so they run on a later step:
- the adapter's `queue_gate` names the ones to hold (shrink mode with SGLANG_PATHP_HOST_MIRROR_GB: a parked
  request while its pages are read back from disk; none otherwise);
- of the others, in order, the step admits the leading ones whose warm starts fit the step's warm-start budget
  (`EngineConfig.warm_step_pages` pages; `offload.step.admit_within` over `OffloadAdapter.warm_cost`, at least one
  a step) and holds the tail, in copy and shrink mode alike. The budget is per decode step (`Runtime.steps`): a
  second call before the same decode forward spends what the first left.
Its Patch row is on with Path-P (the `path_p` feature); without an adapter the call is sglang's own.
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
    held = set(engine.queue_gate([(rid, i, n) for rid, i, n in rows if i is not None], n_next, table_of(pool)))
    free = [(rid, engine.warm_cost(n)) for rid, _, n in rows if rid not in held]
    held |= RUNTIME.step_budget.hold(RUNTIME.steps, engine.cfg.warm_step_pages, free, n_next)
    if not held:
        return original(self, running_batch, *args, **kwargs)
    order = {id(r): i for i, r in enumerate(waiting)}
    back = [r for r in waiting if str(r.rid) in held]
    self.waiting_queue = [r for r in waiting if str(r.rid) not in held]
    try:
        return original(self, running_batch, *args, **kwargs)
    finally:  # the held requests back in their queue order (those sglang added meanwhile after them)
        left = list(self.waiting_queue) + back
        self.waiting_queue = sorted(left, key=lambda r: order.get(id(r), len(waiting)))
