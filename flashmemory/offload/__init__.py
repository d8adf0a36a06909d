"""KV offload serving core: host mirror, device reserve, lookup table, page LRU, request lifecycle.

Cell space (per layer; one cell = one c4 chunk, cell c = offset c % page_chunks of block c // page_chunks):

    | recall blocks [0, R) | decode regions: row r owns D blocks at R + r*D | sink block |

Recall blocks hold whole pages recalled by Level 1, one page per block, handed out from a free list or
taken from the least-recently-used page no live request currently selects. A row's decode region holds
the pages being written during decode (a ring of D pages; a full page leaving it moves to a free recall
block, or stops being resident and stays in the mirror). The sink absorbs writes of padding rows in a
static batch. Path-I index-K blocks share the block ids. The lookup table (mirror chunk -> cell, -1 when
not resident) is the single source of residency truth; per-row page tables map logical pages to mirror pages.

Why the upstream failures cannot happen here:
- Illegal memory access above batch ~80: every buffer (reserve, tables, Level-2 outputs) is sized from
  `EngineConfig` / `Level2(max_batch)` at construction and cells are computed from fixed region bases, so
  no index depends on the batch seen at capture; invalid lookups go to a sentinel entry, padding rows to
  the sink block, and oversize input raises a clear error instead of indexing past the end.
- Cross-request LUT contamination: entries are cleared when a page is evicted and when a request
  finishes, before its mirror pages are freed; rows carry a generation, and recall work planned for an old
  generation is discarded at publish. A reused row starts with an all -1 page table.
- Decode chunks funnelled to a sink: a valid decode chunk always lands in its own page's block (a recall
  block, or the row's own decode region, opened by copying the page from the mirror); only padding rows
  write the sink. A full decode page is promoted or becomes non-resident, counted, never lost (the
  mirror keeps the full history).
- Reserve exhaustion: allocation degrades instead of failing; missing pages are served tail first then by
  score, the rest are dropped and counted (`budget_hits`, `tail_drops`); the per-request cap bounds each
  request's share and a request's current selection is never evicted by another's cycle.
"""

from flashmemory.offload.check import check_invariants
from flashmemory.offload.engine import EngineConfig, OffloadEngine
from flashmemory.offload.layout import OffloadLayout, PageFormat
from flashmemory.offload.mirror import HostMirror, OffloadCapacityError
from flashmemory.offload.recall import (
    Recaller,
    RecallPlan,
    RecallRequest,
    execute_recall,
    gather_copy,
    plan_recall,
    publish_recall,
    recall_now,
)
from flashmemory.offload.reserve import DeviceReserve, TargetIndexPool
from flashmemory.offload.sync import Admission, AppendRound, BatchSync, RowSync, SyncResult

__all__ = [
    "check_invariants",
    "EngineConfig",
    "OffloadEngine",
    "OffloadLayout",
    "PageFormat",
    "HostMirror",
    "OffloadCapacityError",
    "RecallPlan",
    "Recaller",
    "RecallRequest",
    "execute_recall",
    "gather_copy",
    "plan_recall",
    "publish_recall",
    "recall_now",
    "DeviceReserve",
    "TargetIndexPool",
    "Admission",
    "AppendRound",
    "BatchSync",
    "RowSync",
    "SyncResult",
]
