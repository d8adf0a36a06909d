"""Level 1: cadence, the retriever -> policy -> recall pipeline, async publish safety, finish mid-cycle."""

from __future__ import annotations

import threading
import time

import torch

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
from flashmemory.residency.level1 import Level1, Level1Config, retriever_scorer
from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy
from flashmemory.retriever.fp8 import quantize_chunks
from flashmemory.retriever.model import JointRetriever, RetrieverDims

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
HID = {1: torch.zeros(4, 8)}
POS = torch.zeros(4, dtype=torch.long)


def engine(rows: int = 4, blocks: int = 16) -> OffloadEngine:
    return OffloadEngine(
        LAYOUT, EngineConfig(max_rows=rows, max_chunks=64, recall_blocks=blocks, decode_pages=2, max_resident_pages=6)
    )


def admit(eng: OffloadEngine, row: int, n: int = 30) -> int:
    kv = torch.randint(0, 256, (3, n, 8), dtype=torch.uint8)
    ix = torch.stack([quantize_chunks(torch.randn(n, 4)) for _ in range(3)])
    return eng.admit(row, kv, ix)


class Recorder:
    """A scorer that records calls and makes chunk j score j / n (later pages win)."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, row, n, hidden, pos):
        self.calls.append(row)
        return torch.arange(n, dtype=torch.float32) / n


def test_cadence_first_step_then_every_tau_with_stagger():
    eng = engine()
    for r in range(3):
        admit(eng, r)
    rec = Recorder()
    l1 = Level1(
        eng,
        rec,
        ThresholdPagePolicy(SelectionConfig(threshold=0.5, last_keep=4, kmax=6, page_chunks=4)),
        Level1Config(tau=4, stagger=True, max_resident_pages=6, last_keep=4, async_recall=False),
    )
    due = [l1.on_step([0, 1, 2, -1], HID, POS) for _ in range(9)]
    assert due[0] == [0, 1, 2]  # every request is due at its first step
    later = [r for d in due[1:] for r in d]
    assert sorted(later) == [0, 0, 1, 1, 2, 2] and due[1:4] != [[0, 1, 2]] * 3  # phases differ
    assert not check_invariants(eng) and eng.metrics()["total"]["recall_pages"] > 0
    eng.finish(1)
    admit(eng, 1)  # a new occupant is due at once
    assert 1 in l1.on_step([0, 1, 2], HID, POS)


def test_retriever_pipeline_recalls_selected_pages():
    eng = engine()
    gen = admit(eng, 0, n=40)
    dims = RetrieverDims(hidden=8, rank=8, n_heads=2, head_dim=4, rope_dim=2)
    ret = JointRetriever([1], dims)
    policy = ThresholdPagePolicy(SelectionConfig(threshold=0.0, last_keep=8, kmax=6, page_chunks=4))
    l1 = Level1(
        eng,
        retriever_scorer(ret, eng),
        policy,
        Level1Config(tau=64, max_resident_pages=6, last_keep=8, async_recall=False),
    )
    l1.on_step([0], {1: torch.randn(1, 8)}, torch.tensor([160]))
    pages = sorted(eng.rows[0].recall)
    assert len(pages) == 6 and {8, 9} <= set(pages), pages  # tail pages (last 8 chunks) always in
    assert eng.gen(0) == gen and not check_invariants(eng)


def held_copy_level1(eng):
    """An async Level 1 whose copy blocks until `release` is set; `in_copy` fires when the copy starts."""
    in_copy, release = threading.Event(), threading.Event()

    def hook():
        in_copy.set()
        release.wait(5)

    eng.copy_hook = hook
    policy = ThresholdPagePolicy(SelectionConfig(threshold=0.5, last_keep=4, kmax=6, page_chunks=4))
    l1 = Level1(eng, Recorder(), policy, Level1Config(tau=64, max_resident_pages=6, last_keep=4, async_recall=True))
    return l1, in_copy, release


def test_async_delayed_copy_never_exposes_half_written_set():
    eng = engine()
    admit(eng, 0)
    l1, in_copy, release = held_copy_level1(eng)
    try:
        l1.on_step([0], HID, POS)
        assert in_copy.wait(5), "worker never reached the copy"
        # Mid-copy: KV landed, index not yet. Decode keeps going and must only see published, complete pages.
        for _ in range(3):
            assert not check_invariants(eng)
            assert (eng.cells(torch.tensor([0]), torch.arange(28).unsqueeze(0)) == -1).all()  # in flight: unpublished
            eng.decode_append(
                [0],
                torch.randint(0, 256, (3, 1, 8), dtype=torch.uint8),
                torch.randint(0, 256, (3, 1, 8), dtype=torch.uint8),
            )
            time.sleep(0.05)
        assert eng.metrics()["total"]["inflight_blocks"] > 0
        release.set()
        l1.wait()
        assert eng.metrics()["total"]["recall_pages"] > 0 and not check_invariants(eng)
    finally:
        release.set()
        l1.close()


def test_publishing_before_the_copy_is_detected():
    """Control: the invariant check does catch a lookup table written ahead of its bytes."""
    eng = engine()
    gen = admit(eng, 0)
    plan = plan_recall(eng, [RecallRequest(0, gen, (0, 1), (1.0, 1.0))])
    publish_recall(eng, plan)
    assert any("differ from the mirror" in p for p in check_invariants(eng))
    execute_recall(eng, plan)
    assert not check_invariants(eng)


def test_finish_and_reuse_mid_cycle_leak_nothing():
    eng = engine(blocks=8)
    admit(eng, 0)
    admit(eng, 1)
    l1, in_copy, release = held_copy_level1(eng)
    try:
        l1.on_step([0, 1], {1: torch.zeros(2, 8)}, POS[:2])
        assert in_copy.wait(5)
        eng.finish(0)
        admit(eng, 0, n=10)  # row reused while the old request's pages are still being copied
        eng.finish(1)
        release.set()
        l1.wait()
    finally:
        release.set()
        l1.close()
    assert not check_invariants(eng)
    tot = eng.metrics()["total"]
    assert tot["cancelled_pages"] > 0 and tot["free_blocks"] == 8 and tot["inflight_blocks"] == 0
    assert eng.rows[0].recall == {} and (eng.cells(torch.tensor([0]), torch.arange(10).unsqueeze(0)) == -1).all()


def test_warm_start_holds_the_newest_pages_before_the_first_cycle():
    """Admission: the newest KMAX pages (the newest one through open_tail_page) are resident before any cycle,
    with their true bytes, and it is not counted as a Level-1 cycle."""
    from flashmemory.residency.level1 import warm_start

    eng = engine()
    admit(eng, 0, n=30)  # 8 pages of 4 chunks: pages 0..7, newest 7
    eng.open_tail_page(0)
    assert warm_start(eng, 0, kmax=4) == 3
    st = eng.rows[0]
    assert sorted(st.recall) == [4, 5, 6] and 7 in st.ring
    for p, blk in st.recall.items():  # the reserve holds the mirror's bytes of each page
        assert torch.equal(eng.reserve.kv[:, blk], eng.mirror.kv[:, st.mpages[p]].to(eng.reserve.kv.device))
    assert eng.stats.per_req[st.rid].get("cycles", 0) == 0
    assert eng.stats.per_req[st.rid]["warm_start_pages"] == eng.stats.per_req[st.rid]["recall_pages"] == 3
    check_invariants(eng)
    admit(eng, 1, n=3)  # one page only: nothing older to warm
    eng.open_tail_page(1)
    assert warm_start(eng, 1, kmax=3) == 0
