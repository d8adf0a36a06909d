"""Recall planning and publishing hold the engine lock in slices of at most `Recaller.slice_pages` pages, and the
sliced result equals the one-hold result (same blocks, evictions, drops, tables and counters)."""

from __future__ import annotations

import threading

import pytest
import torch

import flashmemory.offload.recall_plan as recall_mod
from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, RecallRequest, check_invariants
from tests.offload.test_sync_batch import state

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
# 6 rows x 40 pages of history, 24 recall blocks: cycles that ask for more than the reserve holds.
CFG = EngineConfig(max_rows=6, max_chunks=160, recall_blocks=24, decode_pages=2, max_resident_pages=8)


class Counting:
    """Stands in for the engine's RLock and counts outermost holds."""

    def __init__(self) -> None:
        self.inner, self.depth, self.holds = threading.RLock(), 0, 0

    def __enter__(self):
        self.inner.acquire()
        self.depth += 1
        self.holds += self.depth == 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        self.inner.release()


def drive(slice_pages: int) -> tuple[OffloadEngine, list[list[tuple]], int]:
    """Admit 6 rows, run three cycles (cold, shifted, exhausted) with the given slice; returns the engine, each
    cycle's plan entries and the number of lock holds the cycles took."""
    eng = OffloadEngine(LAYOUT, CFG)
    eng.recaller.slice_pages = slice_pages
    g = torch.Generator().manual_seed(5)
    gens = []
    for row in range(6):
        kv = torch.randint(0, 256, (3, 157, LAYOUT.kv.chunk_bytes), dtype=torch.uint8, generator=g)
        ix = torch.randint(0, 256, (3, 157, LAYOUT.index.chunk_bytes), dtype=torch.uint8, generator=g)
        gens.append(eng.admit(row, kv, ix))
    eng.lock = lock = Counting()
    plans = []
    for shift in (0, 3, 9):
        reqs = []
        for row in range(6):
            pages = [(row * 5 + shift + k) % 39 for k in range(8)]
            prio = torch.rand(len(pages), generator=g).tolist()
            reqs.append(RecallRequest(row, gens[row], tuple(pages), tuple(prio)))
        plan = eng.recaller.plan(reqs)
        eng.recaller.copy(plan)
        eng.recaller.publish(plan)
        plans.append(list(plan.entries))
        check_invariants(eng)
    return eng, plans, lock.holds


@pytest.mark.parametrize("pause", [128, 2])
def test_sliced_plans_equal_one_hold_plans(monkeypatch, pause: int) -> None:
    """pause: blocks a victim scan examines between pauses (2: long scans are cut across holds too)."""
    one, plans_one, holds_one = drive(10_000)
    monkeypatch.setattr(recall_mod, "PAGE_SCAN_PAUSE", pause)
    sliced, plans_sliced, holds_sliced = drive(3)
    assert plans_sliced == plans_one
    assert sum(map(len, plans_one)) > 24  # the reserve ran out: victims and drops happened
    drops = one.metrics()["total"]["budget_hits"]
    assert drops > 0 and one.metrics()["total"]["evictions"] > 0
    a, b = state(one), state(sliced)
    for k in a:
        if k == "metrics":
            continue
        assert (a[k] == b[k]).all() if torch.is_tensor(a[k]) else a[k] == b[k], k
    assert untimed_totals(one) == untimed_totals(sliced)
    assert holds_sliced > holds_one


def test_a_hold_covers_at_most_one_slice_of_pages() -> None:
    """With slice_pages=3, 48 selected pages over 6 requests of 8 cannot fit in fewer than 16 holds per plan."""
    _, plans, holds = drive(3)
    # per cycle: pass 1 takes one hold per request (8 pages > 3), pass 2 and publish one per 3 pages
    assert holds >= 3 * 6 + sum(2 * -(-len(p) // 3) for p in plans)


def untimed_totals(eng: OffloadEngine) -> dict:
    t = dict(eng.metrics()["total"])
    t.pop("last_cycle", None)
    return {k: v for k, v in t.items() if "latency" not in k}
