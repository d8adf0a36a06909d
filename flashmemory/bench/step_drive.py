"""One decode step of the serving hooks, driven on a synthetic pool: what `flashmemory bench step` times and what
the zero-blocking tests count (tests/bench/test_step_blocking.py).

The pool holds sglang's c4 page layout (37,440-B KV pages, 8,448-B index-K pages, 64-entry c4 pages, 256-token
full pages); its buffers, `req_to_token`, `seq_lens` and `req_pool_indices` are device-standing tensors
(`standin_blocking.on_device`). A step calls what sglang's hooks call, in their order, on the calling thread
(the decode thread): the guard's `Runtime.admission_refusals`, `Runtime.before_forward` (page table, the
adapter's `begin_step`, the Level-2 publish), per c4 layer the indexer hook's `cells_of` and copy mode's
`refresh_from_pool` or shrink mode's `store_cells`, then `Runtime.after_decode_forward` (end of the forward,
shrink mode's settle, Level 1). Mode "off" is the runtime with no adapter: the hooks as sglang runs them with
Path-P off. The stand-in (`standin_streams.install`, `standin_blocking.count_transfers`) is the caller's.
"""

from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from flashmemory.bench.standin_blocking import BLOCKING, Blocking, on_device
from flashmemory.env import FlashMemoryEnv

PAGE = 256  # tokens per full-KV page (64 c4 entries)


def synthetic_pool(layers: int, n_pages: int) -> types.SimpleNamespace:
    """A DSv4 pool as the adapter reads it: per c4 layer a KV and an index-K buffer of n_pages pages (device)."""
    kv = [on_device(torch.zeros(n_pages, 37440, dtype=torch.uint8)) for _ in range(layers)]
    ix = [on_device(torch.zeros(n_pages, 8448, dtype=torch.uint8)) for _ in range(layers)]
    c4 = types.SimpleNamespace(kv_buffer=kv, page_size=PAGE // 4)
    ixp = types.SimpleNamespace(index_k_with_scale_buffer=ix, page_size=PAGE // 4, index_head_dim=128)
    return types.SimpleNamespace(
        c4_kv_pool=c4, c4_indexer_kv_pool=ixp, page_size=PAGE, layer_mapping=[(4, i, c4) for i in range(layers)]
    )


@dataclass
class World:
    """A runtime with its adapter (None: mode "off"), the pool's request table and each request's length."""

    mode: str
    rt: Any
    r2t: torch.Tensor  # int64 [rows + 1, pages * PAGE] full locs (row 0 unused), device
    pages: int  # pool pages per request
    seqs: dict[str, int] = field(default_factory=dict)  # rid -> tokens, the current one included
    slot: dict[str, int] = field(default_factory=dict)  # rid -> req_pool_idx

    @property
    def adapter(self) -> Any:
        return self.rt.engine


def build_world(mode: str, rows: int, pages: int, layers: int = 21, **env_kw: Any) -> World:
    """mode: "copy", "shrink" or "off"; rows: request slots; pages: pool pages per request (history + growth)."""
    from flashmemory.sglang.decode.copy_adapter import CopyAdapter
    from flashmemory.sglang.decode.runtime import Runtime
    from flashmemory.sglang.decode.shrink_adapter import ShrinkAdapter

    kw: dict[str, Any] = dict(
        decode_swap_p=True,
        retriever_layers=(min(10, layers - 1),),
        page_kmax=8,
        reserve_pages=rows * 9,
        decode_max_conc=rows,
        async_recall=True,
        interval=64,
        target_context=PAGE * pages,
    )
    kw.update(env_kw)
    env = FlashMemoryEnv(**kw)
    pool = synthetic_pool(layers, rows * pages + 2)
    rt = Runtime()
    rt.pool, rt.env, rt.diag_path = pool, env, ""
    if mode == "copy":
        rt.engine = CopyAdapter(pool, env)
    elif mode == "shrink":
        rt.engine = ShrinkAdapter(pool, env, n_landing=64)
    elif mode != "off":
        raise ValueError(f"mode {mode!r}: copy, shrink or off")
    r2t = torch.full((rows + 1, pages * PAGE), -1, dtype=torch.int64)
    for r in range(rows):
        r2t[1 + r] = torch.arange((1 + r * pages) * PAGE, (1 + (r + 1) * pages) * PAGE)
    return World(mode, rt, on_device(r2t), pages)


def batch(world: World) -> types.SimpleNamespace:
    """sglang's decode ForwardBatch for the world's live requests (device seq_lens, host seq_lens_cpu)."""
    mode = types.SimpleNamespace(is_decode=lambda: True, is_idle=lambda: False)
    rids = list(world.seqs)
    s = torch.tensor([world.seqs[r] for r in rids], dtype=torch.int64)
    return types.SimpleNamespace(
        forward_mode=mode,
        rids=rids,
        seq_lens=on_device(s.clone()),
        seq_lens_cpu=s,
        req_pool_indices=on_device(torch.tensor([world.slot[r] for r in rids], dtype=torch.int64)),
    )


def forward_layers(world: World, fb: types.SimpleNamespace) -> None:
    """What the hooks run per c4 layer inside the forward: the indexer's picks mapped to cells, then the store
    seam (shrink) or the pool -> reserve refresh before attention (copy); `pool_picks` where rows attend the pool."""
    ad = world.adapter
    if ad is None or not fb.rids:
        return
    n = len(fb.rids)
    # This step's token locs (req_to_token at seq - 1); the c4 entry loc is loc // 4 on closing tokens, else 0.
    pos = torch.tensor([world.seqs[r] - 1 for r in fb.rids])
    loc = world.r2t.as_subclass(torch.Tensor)[torch.tensor([world.slot[r] for r in fb.rids]), pos]
    out_loc = on_device(torch.where((pos + 1) % 4 == 0, loc // 4, torch.zeros_like(loc)))
    picks = on_device(torch.full((n, 8), -1, dtype=torch.int64))
    full = world.rt.fwd.pool_rows  # copy mode, rows before their first Level-1 plan: attention reads the pool
    for layer in range(ad.geo.n_c4_layers):
        ad.cells_of(picks) if full is None else ad.pool_picks(picks, full)
        if ad.mode == "shrink":
            ad.store_cells(out_loc)
        else:
            ad.refresh_from_pool(layer, out_loc)


def step(world: World) -> tuple[float, list[Blocking]]:
    """One decode step of every live request (each then advances one token). Returns (host seconds, the
    blocking operations logged on this thread during it)."""
    rt = world.rt
    fb = batch(world)
    mark = len(BLOCKING)  # other threads (TP ranks) log into the same list: keep this thread's, from here
    t = time.perf_counter()
    rt.admission_refusals(fb)
    rt.before_forward(fb, world.r2t)
    forward_layers(world, fb)
    rt.after_decode_forward(fb)
    dt = time.perf_counter() - t
    me = threading.current_thread().name
    got = [b for b in BLOCKING[mark:] if b.thread == me]
    for r in world.seqs:
        world.seqs[r] += 1
    return dt, got


def admit(world: World, rid: str, tokens: int) -> None:
    """A request joins the next step with `tokens` of history (the current token included)."""
    world.slot[rid] = 1 + len(world.slot)
    world.seqs[rid] = tokens


def finish(world: World, rid: str) -> None:
    """A request leaves: absent from the next step's batch."""
    world.seqs.pop(rid)


def close(world: World) -> None:
    if world.adapter is not None:
        world.adapter.close()
