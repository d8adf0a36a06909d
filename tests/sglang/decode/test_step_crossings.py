"""How often one decode step crosses from the plugin into the offload core, counted through the core's verbs.

Every public method of the core the adapter holds (`OffloadEngine` and its `Level1`) is wrapped with a recorder;
a call counts when the decode thread makes it from outside the core (the core's calls into itself are nested and
not counted). The steps run through sglang's hooks as sglang calls them (the guard's admission check,
`before_forward`, attention per c4 layer, `after_forward`) on the copy-mode adapter over a pool with sglang's c4
page layout. The step under test admits a request while the previous step closed a chunk of another (so its
bytes are settled from the pool) and the new request's first Level-1 cycle is due: the walk in
flashmemory/sglang/README.md ("One decode step, call by call"). The metrics export is off (counted apart)."""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from flashmemory.sglang.decode import hooks
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.geometry import c4_counts
from flashmemory.sglang.decode.guard import Guard
from flashmemory.sglang.decode.runtime import RUNTIME
from tests.sglang.decode.test_copy_adapter import N_C4, PAGE, env, fake_pool, write_chunk

pytestmark = pytest.mark.sglang
PAGES = {"a": [5, 2], "b": [9, 7]}  # pool pages of each request, logical order
SEQ = PAGE + 40  # tokens before the first step: two c4 pages of history
# The walk's crossings on an admitting copy-mode step, in order (refresh_cells once per c4 layer, counted once).
WALK = [
    "engine.free_mirror_pages",
    "engine.begin_forward",
    "engine.sync_batch",
    "engine.refresh_cells",
    "engine.end_forward",
    "l1.on_step",
]


class Recorder:
    """Wraps the public methods of core objects; `calls` lists (verb, args) made from outside them on the
    decode thread (nested calls, and calls on other threads, are not crossings of the decode step)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self._depth = threading.local()
        self._thread = threading.current_thread()

    def wrap(self, obj: Any, who: str) -> None:
        for name in dir(type(obj)):
            if name.startswith("_"):
                continue
            if not isinstance(inspect.getattr_static(type(obj), name), (types.FunctionType, staticmethod)):
                continue  # properties and plain attributes are no calls
            setattr(obj, name, self._recorded(getattr(obj, name), f"{who}.{name}"))

    def _recorded(self, fn: Callable, verb: str) -> Callable:
        def call(*a: Any, **k: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and threading.current_thread() is self._thread:
                self.calls.append((verb, a))
            self._depth.n = depth + 1
            try:
                return fn(*a, **k)
            finally:
                self._depth.n = depth

        return call

    def verbs(self) -> list[str]:
        """Distinct verbs in first-call order (a verb called per c4 layer is one crossing of the step)."""
        return list(dict.fromkeys(v for v, _ in self.calls))


class _Mode:
    def is_decode(self) -> bool:
        return True

    def is_idle(self) -> bool:
        return False


@pytest.fixture
def served(monkeypatch):
    pool, e = fake_pool(3), env()
    adapter = build(pool, e)
    g = Guard(hook_names=hooks.HOOK_NAMES, precheck=hooks._admission_precheck)
    g.stop = lambda msg: pytest.fail(f"the guard stopped the server: {msg}")
    monkeypatch.setattr(RUNTIME, "guard", g)
    fields = dict(env=e, engine=adapter, pool=pool, features=("level2", "path_p"), bufs=None, sideband=None)
    for name, value in dict(fields, metrics=None, steps=0, diag_path="").items():
        monkeypatch.setattr(RUNTIME, name, value)
    r2t = torch.full((2, 4 * PAGE), -1, dtype=torch.int64)
    for i, pages in enumerate(PAGES.values()):
        r2t[i, : len(pages) * PAGE] = torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)])
    mr = types.SimpleNamespace(is_draft_worker=False, req_to_token_pool=types.SimpleNamespace(req_to_token=r2t))
    yield types.SimpleNamespace(adapter=adapter, pool=pool, mr=mr)
    adapter.close()


def _loc(rid: str, chunk: int) -> int:
    return PAGES[rid][chunk // 64] * 64 + chunk % 64


def _step(s: Any, rids: list[str], seq: int) -> None:
    """One decode step of `rids`, all at `seq` tokens with the current one, through the hooks; the chunk it
    closes is stored into the pool during the forward (what sglang's c4 store kernel does)."""
    fb = types.SimpleNamespace(
        forward_mode=_Mode(),
        rids=list(rids),
        req_pool_indices=torch.tensor([list(PAGES).index(r) for r in rids]),
        seq_lens=torch.full((len(rids),), seq, dtype=torch.int64),
    )
    fb.seq_lens_cpu = fb.seq_lens
    hooks.before_forward(s.mr, fb)
    before, after = c4_counts(torch.tensor([seq]))
    closes = int(after) > int(before)
    out_loc = torch.tensor([_loc(r, int(before)) if closes else 0 for r in rids])
    for i in range(len(rids) if closes else 0):
        write_chunk(s.pool, int(out_loc[i]), seed=seq * 10 + i)
    backend = types.SimpleNamespace(
        token_to_kv_pool=s.pool,
        forward_metadata=types.SimpleNamespace(core_metadata=types.SimpleNamespace(c4_out_loc=out_loc)),
    )
    for c4 in range(N_C4):
        hooks.around_attention(
            lambda *a, **k: None, backend, None, None, None, types.SimpleNamespace(layer_id=1 + c4), fb
        )
    hooks.after_forward(None, s.mr, fb)


def test_an_admitting_step_with_its_level1_cycle_crosses_into_the_core_six_times(served):
    s = served
    seq = SEQ + 1
    _step(s, ["a"], seq)
    while True:  # until a step of "a" closes a chunk: its bytes are settled from the pool at the next step
        before, after = c4_counts(torch.tensor([seq]))
        if int(after) > int(before):
            break
        seq += 1
        _step(s, ["a"], seq)
    closed = int(before)
    cycles = s.adapter.engine.metrics()["total"]["cycles"]
    rec = Recorder()
    rec.wrap(s.adapter.engine, "engine")
    rec.wrap(s.adapter.l1, "l1")
    _step(s, ["a", "b"], seq + 1)  # "b" is admitted; its first Level-1 cycle is due at once
    verbs, calls = rec.verbs(), list(rec.calls)
    assert verbs == WALK and len(verbs) <= 6, verbs
    assert set(s.adapter.rows) == {"a", "b"}
    assert s.adapter.engine.metrics()["total"]["cycles"] > cycles  # the cycle ran in this step
    syncs = [a[0] for v, a in calls if v == "engine.sync_batch"]
    stores = getattr(syncs[0], "stores", None) if syncs else None
    assert stores is not None and stores.m.numel() == 1  # last step's chunk of "a" is settled in this step
    # and it was settled with the bytes the pool got during that forward
    m = int(stores.m[0])
    st = s.adapter.engine.storage()
    lay = s.adapter.layout
    mirror = lay.kv.read_chunks(st.mirror_kv, torch.tensor([m // 64]), torch.tensor([m % 64]))
    pool = lay.kv.read_chunks(
        torch.stack(s.pool.c4_kv_pool.kv_buffer), torch.tensor([_loc("a", closed) // 64]), torch.tensor([closed % 64])
    )
    assert torch.equal(mirror, pool)
    rec.calls.clear()
    _step(s, ["a", "b"], seq + 2)  # no admission: no free-page check
    assert rec.verbs() == WALK[1:], rec.verbs()
