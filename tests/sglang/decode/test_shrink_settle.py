"""Shrink mode's settle without a host wait (`ShrinkAdapter.settle` / `_apply_staged`, with the CUDA stand-in on):
the entries sglang's store kernel wrote into reserve cells during a forward reach the host mirror at a later
`begin_step`, byte for byte; a request that left the batch meanwhile gets nothing written (its pool pages may
hold a new PD transfer by then)."""

from __future__ import annotations

import pytest
import torch

from flashmemory.bench import step_drive as sd
from tests.support.cuda_standin import count_blocking

pytestmark = pytest.mark.sglang
SEQ0 = 4 * sd.PAGE - 9  # 1015 tokens: the first step (1015) closes nothing, the second (1016) closes chunk 253


def _forward(world: sd.World, g: torch.Generator) -> dict[int, torch.Tensor]:
    """One decode step whose forward stores random c4 KV where `store_cells` says (sglang's kernel). Returns
    {pool loc: bytes [n_layers, 584]} of the entries it stored."""
    rt, ad = world.rt, world.adapter
    fb = sd.batch(world)
    rt.admission_refusals(fb)
    rt.before_forward(fb, world.r2t)
    pos = torch.tensor([world.seqs[r] - 1 for r in fb.rids])
    loc = world.r2t.as_subclass(torch.Tensor)[torch.tensor([world.slot[r] for r in fb.rids]), pos]
    closing = (pos + 1) % 4 == 0
    out_loc = torch.where(closing, loc // 4, torch.zeros_like(loc))
    cells = ad.store_cells(out_loc).long().as_subclass(torch.Tensor)
    stored = {}
    lay, pc, reserve = ad.layout.kv, ad.geo.page_chunks, ad.engine.storage().reserve_kv
    for i in torch.nonzero(closing).flatten().tolist():
        data = torch.randint(0, 256, (ad.geo.n_c4_layers, 1, lay.chunk_bytes), dtype=torch.uint8, generator=g)
        lay.write_chunks(reserve, cells[i : i + 1] // pc, cells[i : i + 1] % pc, data)
        stored[int(out_loc[i])] = data[:, 0]
    rt.after_decode_forward(fb)
    for r in world.seqs:
        world.seqs[r] += 1
    return stored


def _mirror(ad, loc: int) -> torch.Tensor:
    pc, st = ad.geo.page_chunks, ad.engine.storage()
    row = ad.engine.mirror.rows(torch.tensor([loc // pc]))
    return ad.layout.kv.read_chunks(st.mirror_kv, row, torch.tensor([loc % pc]))[:, 0].as_subclass(torch.Tensor)


def test_staged_settles_reach_the_mirror_for_live_requests_only(monkeypatch):
    count_blocking(monkeypatch)
    world = sd.build_world("shrink", rows=4, pages=6, layers=3, interval=64)
    g = torch.Generator().manual_seed(0)
    try:
        sd.admit(world, "a", SEQ0)
        sd.admit(world, "b", SEQ0)
        assert _forward(world, g) == {}
        stored = _forward(world, g)  # both close a chunk
        assert len(stored) == 2 and not world.adapter._staged == []  # staged, not yet in the mirror
        loc_a, loc_b = sorted(stored)  # "a" holds the lower pool pages
        assert not torch.equal(_mirror(world.adapter, loc_a), stored[loc_a])
        sd.finish(world, "b")  # b leaves; a new PD transfer lands in its freed pages
        poison = torch.full((3, 584), 0xAB, dtype=torch.uint8)
        ad = world.adapter
        pc = ad.geo.page_chunks
        ad.layout.kv.write_chunks(
            ad.engine.storage().mirror_kv,
            ad.engine.mirror.rows(torch.tensor([loc_b // pc])),
            torch.tensor([loc_b % pc]),
            poison.unsqueeze(1),
        )
        _forward(world, g)  # begin_step writes the staged settle: a's chunk only
        assert torch.equal(_mirror(ad, loc_a), stored[loc_a])
        assert torch.equal(_mirror(ad, loc_b), poison)
    finally:
        sd.close(world)
