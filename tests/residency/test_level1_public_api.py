"""Level 1 plans from the engine's public snapshot; the engine's recaller executes. A proxy that exposes only the
public planning surface (no rows, no lock, no LUT) drives a full cycle, with and without the miss monitor's
bookkeeping path, and the result equals the one on the bare engine."""

from __future__ import annotations

from pathlib import Path

import torch

from flashmemory.offload import EngineConfig, OffloadEngine, OffloadLayout, check_invariants
from flashmemory.residency.level1 import Level1, Level1Config, warm_start
from flashmemory.residency.policy import SelectionConfig, ThresholdPagePolicy
from flashmemory.retriever.fp8 import quantize_chunks

LAYOUT = OffloadLayout.tiny(n_layers=3, page_chunks=4, target_layers=(1,))
PUBLIC = {"layout", "snapshot_rows", "gen", "note", "recaller", "target_keys", "record"}


class PublicOnly:
    """The engine as Level 1 may see it: anything outside PUBLIC raises."""

    def __init__(self, eng: OffloadEngine):
        object.__setattr__(self, "eng", eng)

    def __getattr__(self, name: str):
        if name not in PUBLIC:
            raise AssertionError(f"Level 1 reached engine.{name}, outside its public planning surface")
        return getattr(object.__getattribute__(self, "eng"), name)


def engine() -> OffloadEngine:
    eng = OffloadEngine(
        LAYOUT, EngineConfig(max_rows=4, max_chunks=64, recall_blocks=16, decode_pages=2, max_resident_pages=6)
    )
    g = torch.Generator().manual_seed(0)
    for row, n in ((0, 30), (2, 21)):
        kv = torch.randint(0, 256, (3, n, 8), dtype=torch.uint8, generator=g)
        ix = torch.stack([quantize_chunks(torch.randn(n, 4, generator=g)) for _ in range(3)])
        eng.admit(row, kv, ix)
    return eng


def scores(row, n, hidden, pos):
    return torch.arange(n, dtype=torch.float32) / n


def run(view) -> None:
    l1 = Level1(
        view,
        scores,
        ThresholdPagePolicy(SelectionConfig(threshold=0.5, last_keep=4, kmax=6, page_chunks=4)),
        Level1Config(tau=2, max_resident_pages=6, last_keep=4, async_recall=False),
    )
    hid, pos = {1: torch.zeros(3, 8)}, torch.zeros(3, dtype=torch.long)
    for _ in range(3):
        l1.on_step([0, -1, 2], hid, pos)
    l1.close()


def test_level1_runs_on_the_public_snapshot_only() -> None:
    bare, proxied = engine(), engine()
    run(bare)
    run(PublicOnly(proxied))
    assert torch.equal(bare.lut.table, proxied.lut.table) and torch.equal(bare.res_pages, proxied.res_pages)
    assert proxied.metrics()["total"]["cycles"] == 4 and not check_invariants(proxied)
    assert warm_start(PublicOnly(engine()), 0, 3) == 2


def test_no_serving_core_module_reaches_engine_rows_or_lock_from_outside() -> None:
    """Source check beside the behavioural one: planners read the snapshot, the recaller is handed its parts."""
    root = Path(__file__).resolve().parents[2] / "flashmemory"
    for rel in (
        "residency/level1.py",
        "residency/monitored.py",
        "offload/recall.py",
        "sglang/decode/offload_adapter.py",
        "sglang/decode/copy_adapter.py",
        "sglang/decode/shrink_adapter.py",
    ):
        text = (root / rel).read_text()
        assert "engine.rows" not in text and "eng.rows" not in text, rel
    text = (root / "residency" / "level1.py").read_text()
    assert ".lock" not in text, "level1.py takes the engine lock"
