"""The PD decode waiting queue under the per-step warm-start budget (`queue_gate.around_prebuilt_batch`): a burst of
arrivals is admitted a budget's worth per decode step, in queue order, in copy and shrink mode alike, so the
warm starts of one step never exceed `EngineConfig.warm_step_pages` (the first request of a step runs even over
it); the held requests run on later steps. Fakes stand for sglang's scheduler (its `_get_new_prebuilt_batch` takes
the first free-slot's worth of the queue) and for the adapter's two queue verbs; a last test takes the costs
from a real adapter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashmemory.bench import step_drive as sd
from flashmemory.offload.step import StepBudget
from flashmemory.sglang.decode import queue_gate
from flashmemory.sglang.decode.runtime import RUNTIME

pytestmark = pytest.mark.sglang
BUDGET = 16
TOKENS = 1024  # landed tokens of each request in the burst


class Adapter:
    """The adapter's queue verbs: each request's warm start costs `cost` pages (3: a 4-page history, KMAX 8),
    and `parked` names the requests the disk tier's cap holds (shrink mode)."""

    def __init__(self, cost: int = 3, parked: set[str] | None = None) -> None:
        self.cfg = SimpleNamespace(warm_step_pages=BUDGET)
        self.cost, self.parked = cost, parked or set()

    def queue_gate(self, waiting, n_next, table_of):
        return {rid for rid, _, _ in waiting} & self.parked

    def warm_cost(self, tokens: int) -> int:
        return self.cost if tokens == TOKENS else 0


def _req(rid: str, tokens: int = TOKENS) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, kv=SimpleNamespace(req_pool_idx=1), origin_input_ids=[0] * tokens, output_ids=[1])


def _scheduler(n: int, slots: int) -> SimpleNamespace:
    return SimpleNamespace(
        waiting_queue=[_req(f"r{i}") for i in range(n)],
        req_to_token_pool=SimpleNamespace(size=slots, req_to_token=None),
        max_running_requests=slots,
    )


def _take(running: list[str]):
    """sglang's `_get_new_prebuilt_batch`: the first free-slot's worth of the queue joins the running batch."""

    def original(self, running_batch):
        n = max(0, min(self.req_to_token_pool.size, self.max_running_requests) - running_batch.batch_size())
        taken, self.waiting_queue = self.waiting_queue[:n], self.waiting_queue[n:]
        running.extend(r.rid for r in taken)
        return taken or None

    return original


@pytest.fixture
def gate(monkeypatch):
    monkeypatch.setattr(queue_gate.RUNTIME, "step_budget", StepBudget())

    def use(adapter: Adapter) -> None:
        monkeypatch.setattr(RUNTIME, "engine", adapter)
        monkeypatch.setattr(RUNTIME, "steps", 0)

    return use


def _steps(sched: SimpleNamespace, n_steps: int, calls_per_step: int = 1) -> list[list[str]]:
    """Per decode step, the requests that joined the running batch (the gate called `calls_per_step` times)."""
    running: list[str] = []
    original = _take(running)
    batch = SimpleNamespace(batch_size=lambda: len(running))
    out = []
    for _ in range(n_steps):
        before = len(running)
        for _ in range(calls_per_step):
            queue_gate.around_prebuilt_batch(original, sched, batch)
        out.append(running[before:])
        RUNTIME.steps += 1  # the decode forward (`Runtime.after_decode_forward`)
    return out


@pytest.mark.parametrize("calls_per_step", [1, 2])
def test_a_burst_is_admitted_a_budget_per_step_in_order(gate, calls_per_step):
    gate(Adapter())
    sched = _scheduler(12, slots=64)
    per_step = _steps(sched, 4, calls_per_step)
    # 3 pages each, 16 a step: five a step, in queue order; the rest wait in the queue, in order, for later steps.
    assert per_step == [[f"r{i}" for i in range(k, min(k + 5, 12))] for k in (0, 5, 10)] + [[]]
    assert all(3 * len(s) <= BUDGET for s in per_step) and sched.waiting_queue == []


def test_the_budget_holds_only_what_sglang_would_take(gate):
    """With two free slots sglang takes two, within the budget: nothing is held and the queue stays as it was."""
    gate(Adapter())
    sched = _scheduler(6, slots=2)
    assert _steps(sched, 1) == [["r0", "r1"]]
    assert [r.rid for r in sched.waiting_queue] == ["r2", "r3", "r4", "r5"]


def test_a_request_over_the_budget_runs_alone(gate):
    gate(Adapter(cost=40))
    sched = _scheduler(3, slots=8)
    sched.waiting_queue.insert(1, _req("short", tokens=12))  # a history with no older page: no warm pages
    assert _steps(sched, 5) == [["r0"], ["short"], ["r1"], ["r2"], []]


def test_parked_requests_and_the_budget_together_keep_the_queue_order(gate):
    """Shrink mode under the disk tier's cap: a parked request stays held (its pages are on disk) while the
    budget admits the others in order; once its pages are back it runs, ahead of the later arrivals."""
    ad = Adapter(parked={"r1"})
    gate(ad)
    sched = _scheduler(12, slots=64)
    got = _steps(sched, 1)
    assert got == [["r0", "r2", "r3", "r4", "r5"]]
    assert [r.rid for r in sched.waiting_queue] == ["r1"] + [f"r{i}" for i in range(6, 12)]
    ad.parked = set()
    assert _steps(sched, 1) == [["r1", "r6", "r7", "r8", "r9"]]


@pytest.mark.parametrize("mode", ["copy", "shrink"])
def test_a_real_adapters_warm_cost_is_the_cores_warm_pages(mode):
    """The cost a request waits on is the host -> device pages its admission's warm start takes: its history's
    pages up to KMAX, less the newest (a decode block)."""
    world = sd.build_world(mode, rows=2, pages=6, layers=2, page_kmax=3, reserve_pages=16)
    try:
        ad = world.adapter
        assert ad.cfg.warm_step_pages == BUDGET and ad.level1_cfg.max_resident_pages == 3
        assert [ad.warm_cost(t) for t in (3, 4, 256, 260, 4 * 256, 6 * 256)] == [0, 0, 0, 1, 2, 2]
    finally:
        sd.close(world)
