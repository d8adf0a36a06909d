"""`check_invariants(engine)`: recompute the engine's safety invariants from its raw tensors (debug / tests).

Cheap enough to run after every step at test sizes; at serving sizes it reads the whole reserve, so use it
only in debug runs. Returns a list of violations (empty = consistent). Call it while no recall is being
copied, or hold `engine.lock` (in-flight blocks are excluded from byte checks by construction: they are
never in the lookup table).

With a landing window (`HostMirror.slot_of`), a page whose slot was released is compared against the bytes the
disk tier holds (`engine.held_page(row, page)`); the mirror's own pages are read through `HostMirror.rows`.
"""

from __future__ import annotations

import torch

from flashmemory.offload.counters import COUNTERS
from flashmemory.offload.engine import OffloadEngine
from flashmemory.offload.mirror import RELEASED


def _host_pages(
    eng: OffloadEngine, keys: list[tuple[int, int, int]], m_chunks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host copy of the pages holding mirror chunks m_chunks [n]: (kv uint8 [L, P, W], Path-I index
    [Li, P, Wi], page rows int64 [n] into them). A full-size mirror is its own copy; with a window, pages
    keys [(row, logical page, mirror page)] are gathered from their slots, or from the disk tier's bytes for a
    page released from the window."""
    m, pc = eng.mirror, eng.layout.page_chunks
    if m.slot_of is None:
        return m.kv, m.index, m_chunks // pc
    from flashmemory.offload.disk.format import unpack_rows

    kv = torch.empty((m.kv.shape[0], len(keys), m.kv.shape[2]), dtype=torch.uint8)
    ix = torch.empty((m.index.shape[0], len(keys), m.index.shape[2]), dtype=torch.uint8)
    for i, (row, page, mp) in enumerate(keys):
        if int(m.slot_of[mp]) == RELEASED:
            kv[:, i], ix[:, i] = unpack_rows(eng.held_page(row, page), eng.layout)
        else:
            s = m.row(mp)
            kv[:, i], ix[:, i] = m.kv[:, s], m.index[:, s]
    local = {mp: i for i, (_, _, mp) in enumerate(keys)}
    return kv, ix, torch.tensor([local[int(p)] for p in (m_chunks // pc).tolist()], dtype=torch.int64)


def _running_totals(eng: OffloadEngine, resident_chunks: int) -> list[str]:
    """The metrics' running totals (`OffloadMetrics.totals`) against a scan of the rows: resident pages and history
    chunks of the live rows, resident chunks (`resident_chunks`: live history entries set in the table), and each
    counter summed over the live and finished requests. Call under the lock."""
    tot, bad = eng.stats.totals(), []
    live = [st for st in eng.rows if st is not None]
    scan = {
        "resident_pages": sum(len(st.recall) + sum(p >= 0 for p in st.ring) for st in live),
        "resident_chunks": resident_chunks,
        "history_chunks": sum(st.n_chunks for st in live),
    }
    snap = eng.stats.snapshot({})["total"]
    scan.update({k: snap[k] for k in COUNTERS})
    for k, v in scan.items():
        if tot[k] != v:
            bad.append(f"running total {k} = {tot[k]} but the rows add up to {v}")
    return bad


def check_invariants(eng: OffloadEngine) -> list[str]:
    eng.flush_lands()  # admissions on their way to the mirror land first (the mirror is compared below)
    bad: list[str] = []
    lay, res, pc = eng.layout, eng.reserve, eng.layout.page_chunks
    with eng.lock:
        table = eng.lut.table.cpu()
        if int(table[-1]) != -1:
            bad.append("sentinel entry is not -1")
        ms, cells, keys = [], [], []
        own = torch.tensor(
            [o if o is not None else (-1, -1, -1) for o in eng.owner] + [(-1, -1, -1)], dtype=torch.int64
        )
        row_pages, res_count = eng.lut.row_pages.cpu(), eng.res_count.cpu()
        for r, st in enumerate(eng.rows):
            rp = row_pages[r]
            if st is None:
                if (rp != -1).any():
                    bad.append(f"row {r} is free but its page table is not cleared")
                if int(res_count[r]) != 0:
                    bad.append(f"row {r} is free but has {int(res_count[r])} resident pages in its table")
                continue
            if rp[: len(st.mpages)].tolist() != st.mpages or (rp[len(st.mpages) :] != -1).any():
                bad.append(f"row {r}: page table {rp.tolist()} != mirror pages {st.mpages}")
            if len(st.recall) > eng.cfg.max_resident_pages:
                bad.append(f"row {r}: {len(st.recall)} recalled pages > cap {eng.cfg.max_resident_pages}")
            ring = {p for p in st.ring if p >= 0}
            if ring & st.recall.keys():
                bad.append(f"row {r}: pages {ring & st.recall.keys()} both recalled and in the decode region")
            if int(res_count[r]) != len(st.recall) + len(ring):
                bad.append(f"row {r}: compact table count {int(res_count[r])} != {len(st.recall) + len(ring)}")
            for p, b in st.recall.items():
                if eng.owner[b] != (r, st.gen, p) or b in eng.inflight:
                    bad.append(f"row {r} page {p}: block {b} owner {eng.owner[b]} (inflight={b in eng.inflight})")
            j = torch.arange(st.n_chunks)
            m = torch.tensor(st.mpages, dtype=torch.int64)[j // pc] * pc + j % pc
            c = table[m].long()
            live = c >= 0
            ms.append(m[live])
            cells.append(c[live])
            if eng.mirror.slot_of is not None:
                keys += [(r, p, st.mpages[p]) for p in sorted(set((j[live] // pc).tolist()))]
            blk = c[live] // pc
            lo, hi = res.decode_block(r, 0), res.decode_block(r, res.decode_pages - 1)
            o = own[blk.clamp(max=res.recall_blocks)]
            mine = (o[:, 0] == r) & (o[:, 1] == st.gen) & (o[:, 2] == j[live] // pc)
            if not (mine | ((blk >= lo) & (blk <= hi))).all():
                bad.append(
                    f"row {r}: a chunk's cell is neither in its page's recall block nor in the row's decode region"
                )
        m = torch.cat(ms) if ms else torch.zeros(0, dtype=torch.int64)
        c = torch.cat(cells) if cells else torch.zeros(0, dtype=torch.int64)
        if int((table[:-1] >= 0).sum()) != m.numel():
            bad.append(
                f"{int((table[:-1] >= 0).sum())} table entries are set but only {m.numel()} belong to live history"
            )
        bad += _running_totals(eng, m.numel())
        if c.numel() != c.unique().numel():
            bad.append("a reserve cell is mapped by two chunks")
        if c.numel() and (c.max() >= res.sink_cell or c.min() < 0):
            bad.append(f"a cell lies outside [0, sink_cell={res.sink_cell})")
        if c.numel():
            kv_h, ix_h, hp = _host_pages(eng, keys, m)  # the resident chunks' host pages
            kv_r = lay.kv.read_chunks(res.kv.cpu(), c // pc, c % pc)
            kv_m = lay.kv.read_chunks(kv_h.contiguous(), hp, m % pc)
            if not torch.equal(kv_r, kv_m):
                n_bad = int((kv_r != kv_m).any(-1).any(0).sum())
                bad.append(f"{n_bad} resident chunks: c4 KV bytes in the reserve differ from the mirror")
            if res.index.shape[0]:
                ix_r = lay.index.read_chunks(res.index.cpu(), c // pc, c % pc)
                ix_m = lay.index.read_chunks(ix_h.contiguous(), hp, m % pc)
                if not torch.equal(ix_r, ix_m):
                    bad.append("resident chunks: Path-I index bytes in the reserve differ from the mirror")
        owned = [b for b, o in enumerate(eng.owner) if o is not None]
        free = eng.blocks.free_blocks()
        if len(set(free)) != len(free) or set(free) & set(owned) or len(free) + len(owned) != res.recall_blocks:
            bad.append(
                f"recall blocks leak or double-book: {len(free)} free + {len(owned)} owned != {res.recall_blocks}"
            )
        for b in owned:
            row, gen, page = eng.owner[b]
            st = eng.rows[row]
            if b not in eng.inflight and (st is None or st.gen != gen or st.recall.get(page) != b):
                bad.append(f"block {b} owned by dead or mismatched request {eng.owner[b]} and not in flight")
        if set(eng.lru) != {b for b in owned if b not in eng.inflight}:
            bad.append("LRU does not hold exactly the published recall blocks")
    return bad
