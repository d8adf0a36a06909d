"""Escalation controller under random admit / cycle / finish-mid-cycle / reuse sequences (hypothesis state machine).

Checked after every step: every offload invariant (`check_invariants`), base <= budget <= cap per request, the
grants of the tracked requests add up to `granted` <= the shared pool, only live requests are tracked once
Level 1 has synced, and a request never holds more recalled pages than its budget (+1: the newest page stays).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flashmemory.offload import (
    EngineConfig,
    OffloadEngine,
    OffloadLayout,
    RecallRequest,
    check_invariants,
    execute_recall,
    plan_recall,
    publish_recall,
)
from flashmemory.residency.escalation import EscalationConfig, EscalationController
from flashmemory.residency.level1 import Level1, Level1Config
from flashmemory.residency.monitored import MissMonitor, merge_selection
from flashmemory.retriever.fp8 import quantize_chunks

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(0, 2))
ROWS, CAP, BASE, POOL = 6, 5, 2, 4
STEPS = [0]
EVENTS: dict[str, int] = {}  # escalation counters summed over every example: the rules reach each path
torch.set_num_threads(1)


def chunks(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.randint(0, 256, (3, n, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
    ix = torch.stack([quantize_chunks(torch.randn(n, LAYOUT.index_head_dim, generator=g)) for _ in range(3)])
    return kv, ix


class ControllerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # recall_blocks below ROWS * CAP: reserve pressure is real, widening and recall both degrade.
        self.eng = OffloadEngine(
            LAYOUT, EngineConfig(max_rows=ROWS, max_chunks=40, recall_blocks=14, decode_pages=1, max_resident_pages=CAP)
        )
        self.ctl = EscalationController(
            EscalationConfig(
                threshold=0.3,
                low_threshold=0.1,
                base=BASE,
                cap=CAP,
                step=2,
                shrink_after=1,
                fallback_after=2,
                extra_pool=POOL,
                topk=6,
            ),
            free_blocks=lambda: len(self.eng.blocks),
        )
        self.hot: dict[int, int] = {}  # row -> the page native attention sits on (absent: attention on the tail)
        self.mon = MissMonitor(self.eng, self.native, self.ctl, layers=(0, 2))
        recency = lambda s, n, b: torch.arange(max(0, -(-n // 4) - b), -(-n // 4))  # noqa: E731
        self.l1 = Level1(
            self.eng,
            lambda r, n, h, p: torch.zeros(n),
            recency,
            Level1Config(tau=1, max_resident_pages=BASE, last_keep=4, async_recall=False),
            monitor=self.mon,
        )
        self.g = torch.Generator().manual_seed(0)
        self.live: dict[int, int] = {}

    def native(self, row, layer, n, hidden, pos):
        x = torch.linspace(-3, 0, n)
        p = self.hot.get(row)
        if p == -1:  # adversarial: attention always on non-resident chunks (a request that keeps missing -> fallback)
            from flashmemory.residency.monitor import resident_mask

            return x + 10.0 * (~resident_mask(self.eng, row, n)).float()
        if p is not None and p * 4 < n:
            x[p * 4 : min(n, p * 4 + 4)] = 4.0
        return x

    def teardown(self) -> None:
        self.l1.close()
        tot = self.eng.metrics()["total"]
        for k in ("escalations", "escalations_denied", "shrinks", "fallbacks", "fallback_exits", "missing_pages_added"):
            EVENTS[k] = EVENTS.get(k, 0) + tot[k]

    @rule(row=st.integers(0, ROWS - 1), n=st.integers(1, 36))
    def admit(self, row: int, n: int) -> None:
        if row not in self.live:
            self.live[row] = self.eng.admit(row, *chunks(n, self.g))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def set_hot(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.live)))
        pages = -(-self.eng.n_chunks(row) // 4)
        hot = data.draw(st.one_of(st.none(), st.integers(-1, pages - 1)))
        if hot is None:
            self.hot.pop(row, None)
        else:
            self.hot[row] = hot

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1))
        h = {0: torch.zeros(len(rows), 8), 2: torch.zeros(len(rows), 8)}
        self.l1.on_step(rows, h, torch.zeros(len(rows), dtype=torch.long))
        grow = [r for r in rows if self.eng.n_chunks(r) < 40]
        if grow:
            self.eng.decode_append(grow, *chunks(len(grow), self.g))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), reuse=st.booleans())
    def finish_mid_cycle(self, data, reuse: bool) -> None:
        """Monitor + plan for some requests, then one finishes (and its row is reused) before the copy publishes."""
        rows = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1))
        reqs = []
        for r in rows:
            n, gen = self.eng.n_chunks(r), self.live[r]
            budget, extra, prio = self.mon.cycle(r, gen, n, {}, torch.tensor(0))
            pages, pr = merge_selection([-(-n // 4) - 1], [float("inf")], extra, prio, budget)
            reqs.append(RecallRequest(r, gen, tuple(pages), tuple(pr), budget=budget))
        plan = plan_recall(self.eng, reqs)
        victim = rows[0]
        self.eng.finish(victim)
        del self.live[victim]
        self.hot.pop(victim, None)
        if reuse:
            self.live[victim] = self.eng.admit(victim, *chunks(data.draw(st.integers(1, 36)), self.g))
        execute_recall(self.eng, plan)
        publish_recall(self.eng, plan)
        # The stale request's state goes at the next Level-1 step (here: a step with no due row).
        self.l1.on_step([-1], {}, torch.zeros(1, dtype=torch.long))
        assert victim not in self.ctl.snapshot() or self.ctl.snapshot()[victim][0] == self.live.get(victim)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def missing_burst(self, data) -> None:
        """One request keeps missing for several cycles in a row, then its attention returns to the tail."""
        row = data.draw(st.sampled_from(sorted(self.live)))
        self.hot[row] = -1
        h = {0: torch.zeros(1, 8), 2: torch.zeros(1, 8)}
        for _ in range(data.draw(st.integers(2, 4))):
            self.l1.on_step([row], h, torch.zeros(1, dtype=torch.long))
        if data.draw(st.booleans()):
            self.hot.pop(row, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.live)))
        self.eng.finish(row)
        del self.live[row]
        self.hot.pop(row, None)

    @invariant()
    def consistent(self) -> None:
        STEPS[0] += 1
        problems = check_invariants(self.eng)
        assert not problems, problems
        snap = self.ctl.snapshot()
        for row, (_gen, budget, _) in snap.items():
            assert BASE <= budget <= CAP, f"row {row}: budget {budget} outside [{BASE}, {CAP}]"
        live_grants = sum(b - BASE for _, b, _ in snap.values())
        assert self.ctl.granted == live_grants, f"granted {self.ctl.granted} != tracked grants {live_grants}"
        assert 0 <= self.ctl.granted <= POOL
        self.l1.on_step([-1], {}, torch.zeros(1, dtype=torch.long))  # sync: only live requests stay tracked
        snap = self.ctl.snapshot()
        assert all(self.live.get(r) == g for r, (g, _, _) in snap.items()), (snap, self.live)
        assert self.ctl.granted == sum(b - BASE for _, b, _ in snap.values())
        for r, (_g, b, _) in snap.items():
            assert len(self.eng.rows[r].recall) <= min(CAP, b + 1), "recalled pages beyond the request's budget"
        if not self.live:
            assert self.ctl.granted == 0


ControllerMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
)
TestControllerMachine = ControllerMachine.TestCase


def test_machine_ran_enough_steps():
    if STEPS[0] == 0:
        import pytest

        pytest.skip("state machine not run in this session")
    assert STEPS[0] >= 800, f"only {STEPS[0]} checked steps"
    assert all(v > 0 for v in EVENTS.values()) and len(EVENTS) == 6, str(EVENTS)
    print(f"controller machine: {STEPS[0]} checked steps, events {EVENTS}")
