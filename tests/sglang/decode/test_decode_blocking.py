"""Blocking operations on the decode thread, counted with the CUDA stand-in (`flashmemory.bench.standin_blocking`).

A GPU host blocks on a host read of device values, a copy from pageable host memory, or a synchronize; under
sglang's overlap scheduler each one drains the pipeline. The serving hooks run one decode step at a time on a
synthetic pool (`flashmemory.bench.step_drive`), in copy mode, shrink mode and tensor-parallel lockstep (TP=2:
two ranks, each on its own decode thread, publishing Level-1 cycles in lockstep), through the steps that do
different work: quiet steps, an admitting step, a chunk-closing step (and the step after it, which settles that
chunk), a page-opening step, and steps where a Level-1 cycle is submitted and published. Every step must leave
no blocking operation on its decode thread except the one below, needed because a host structure must hold a
device value (cost on a GPU: one small synchronous read on the steps named):

  `pool_pages` d2h (copy and shrink modes, admitting steps only): the new requests' pool page table
      ([B, P] int64) is read back: sglang keeps `req_to_token` on the device only, and the adapter must claim
      (shrink) or read (copy) those pages on the host before the request's first forward.
It is `ALLOWED` below, by (kind, function); anything else fails the test with its file:line. The step after a
chunk closes settles its bytes with none: copy mode gathers them from sglang's pool on the device and the core
stages them for the mirror through pinned memory and an event (`OffloadEngine.stage_chunks`); shrink mode's settle
does the same from the reserve (`stage_settle`).
"""

from __future__ import annotations

import threading

import pytest
import torch

from flashmemory.bench import step_drive as sd
from flashmemory.sglang.decode import offload_adapter
from tests.support.cuda_standin import count_blocking

pytestmark = pytest.mark.sglang
PAGE = sd.PAGE
ALLOWED = {
    "copy": {"admit": {("d2h", "pool_pages")}, "settle": set()},
    "shrink": {"admit": {("d2h", "pool_pages")}, "settle": set()},
}
# Files of changes made beside this one (pool loc -> mirror chunk map: prefix sharing); their blocking operations
# are reported by `test_other_areas_are_reported` and not failed here.
OTHER_AREAS = ("sglang/decode/loc_map.py",)
SEQ0 = 4 * PAGE - 9  # 1015 tokens: chunks close at 1016, 1020, 1024, 1028; page 4 opens at 1025, fills at 1028
STEPS = 16
TAU = 4


def _phases(seqs: list[int], joined: bool) -> set[str]:
    """What a step over requests at `seqs` tokens does (the adapter's view)."""
    out = set()
    if joined:
        out.add("admit")
    if any(s % 4 == 1 for s in seqs):  # a chunk closed by the last step settles now (copy mode reads the pool)
        out.add("settle")
    return out


class Rotating:
    """Level-1 scores favouring another old page every cycle, so every cycle recalls (and evicts) a page."""

    def __init__(self) -> None:
        self.cycle = 0

    def __call__(self, row: int, n_hist: int, hidden: object, position: torch.Tensor) -> torch.Tensor:
        self.cycle += 1
        s = torch.zeros(n_hist)
        p = (self.cycle + row) % 3
        s[p * 64 : (p + 1) * 64] = 1.0
        return s


def _drive(mode: str, name: str, steps: int = STEPS, until_recall: bool = False) -> tuple[list[tuple], dict]:
    """Run one rank's decode thread: two requests from the first step, a third joining at step 5. Returns per step
    (step, phases, blocking operations on this thread, resident pages) and the core's totals."""
    world = sd.build_world(mode, rows=4, pages=6, layers=3, interval=TAU, page_kmax=2, reserve_pages=16, last_keep=64)
    world.adapter.l1.scorer = Rotating()
    out = []
    try:
        sd.admit(world, "a", SEQ0)
        sd.admit(world, "b", SEQ0)
        for k in range(steps):
            joined = k == 0
            if k == 5:
                sd.admit(world, "late", 2 * PAGE + 50)
                joined = True
            seqs = list(world.seqs.values())
            _, got = sd.step(world)
            out.append((k, _phases(seqs, joined), got, world.adapter.step_resident_pages().tolist()))
        world.adapter.l1.wait()
        totals = world.adapter.engine.metrics()["total"]
        for k in range(steps, steps + 8 * TAU):  # a slow worker published no recall yet: more cycles, each awaited
            if not until_recall or totals["recall_pages"] > totals["warm_start_pages"]:
                break
            seqs = list(world.seqs.values())
            _, got = sd.step(world)
            out.append((k, _phases(seqs, False), got, world.adapter.step_resident_pages().tolist()))
            world.adapter.l1.wait()
            totals = world.adapter.engine.metrics()["total"]
    finally:
        sd.close(world)
    return out, totals


def _unexpected(mode: str, per_step: list) -> list[str]:
    bad = []
    for k, phases, got, _ in per_step:
        ok = set().union(*(ALLOWED[mode][p] for p in phases)) if phases else set()
        bad += [
            f"step {k} {sorted(phases)}: {b.kind} {b.where}"
            for b in got
            if (b.kind, b.function) not in ok and not b.where.startswith(OTHER_AREAS)
        ]
    return bad


@pytest.mark.parametrize("mode", ["copy", "shrink"])
def test_decode_thread_blocks_only_where_listed(mode, monkeypatch):
    si = count_blocking(monkeypatch)
    per_step, totals = _drive(mode, "MainThread", until_recall=True)
    bad = _unexpected(mode, per_step)
    assert not bad, f"{len(bad)} blocking operations on the decode thread:\n" + "\n".join(bad[:40])
    # The counter sees what it must: the admission's listed read; Level-1 cycles recalled beyond the warm starts,
    # on the worker, which waits for its copies (off the decode thread).
    assert per_step[0][2], "the admitting step logged nothing: is the stand-in counting?"
    assert totals["cycles"] >= 4 and totals["recall_pages"] > totals["warm_start_pages"] > 0, totals
    assert any(t == "flashmemory-level1" for t, _ in si.host_syncs), "no Level-1 copy waited on the worker"


@pytest.mark.parametrize("mode", ["copy", "shrink"])
def test_tp2_lockstep_ranks_block_only_where_listed(mode, monkeypatch):
    """Two ranks (threads, as two TP processes would run) with lockstep publishing (publish lag 2): a cycle's
    plan, copy and publish happen on each rank's decode thread at the same step; none of it may wait for the
    device, and both ranks end with the same resident pages."""
    count_blocking(monkeypatch)
    monkeypatch.setattr(offload_adapter, "serving_tp_size", lambda: 2)
    res: dict[str, list] = {}
    errors: list[BaseException] = []

    def rank(name: str) -> None:
        try:
            res[name], totals = _drive(mode, name)
            assert totals["cycles"] >= 4 and totals["recall_pages"] > totals["warm_start_pages"] > 0, totals
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(f"rank{i}",), name=f"rank{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for name in ("rank0", "rank1"):
        bad = _unexpected(mode, res[name])
        assert not bad, f"{name}: {len(bad)} blocking operations on its decode thread:\n" + "\n".join(bad[:40])
    assert [s[3] for s in res["rank0"]] == [s[3] for s in res["rank1"]], "the ranks' resident pages differ"
