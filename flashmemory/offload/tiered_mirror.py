"""The disk tier wired under the host mirror: `TieredEngine` = `OffloadEngine` + a `HostPageCache`.

What changes against the plain engine (which `build_engine` returns whenever the tier is off, so the gates-off
path is the unchanged engine):

seal     At the start of every `sync_batch` (once the step's stores, last step's entries, are in the mirror),
         each live request's complete pages (every logical page before the one holding its newest chunk) that
         are not sealed yet are packed (`disk.format.pack_page`: all c4 KV layers + Path-I index-K) and put into
         the host page cache as dirty pages; when the cache overflows, its least recently used pages are
         written behind to the page store (a disk full / EIO write keeps the page in DRAM, counted). A sealed
         page never changes again (decode only writes the newest page), so the tier's copy stays exact.
         A request is sealed from its second step on: its admission step (tail page, warm start) reads the mirror
         (with a landing window its complete pages go to the tier at admission instead; see below).
recall   The recaller's copy of a plan comes here (`copy_plan`): sealed pages are read through the cache (read-
         ahead of the whole plan first, on the cache's reader threads, so later pages arrive while earlier ones
         are copied; a miss reads from disk and verifies the checksum), unsealed pages from the mirror; then one
         indexed copy per layer group into the reserve, as the mirror path does. A page that fails verification
         (or cannot be read) drops every entry of its request from the plan (blocks freed, nothing of it
         published) and sets `plan.error` to a `CorruptPageError` naming the request and page: the recaller
         publishes the others, then raises it (the sglang adapter turns it into that request's failure).
finish   The request's cache pages and disk slots are freed (space returns), then pinned pages are retried.

Landing window (SGLANG_PATHP_HOST_MIRROR_GB, `EngineConfig.mirror_slots`): the mirror's tensors hold far fewer
DRAM page slots than it has page ids (`HostMirror` translates ids to slots). `seal` releases a page's slot right
after `tier.put` (the cache holds the bytes, pinned there if the disk refuses them); an admission lands only its
tail page in the mirror: its complete pages are packed straight from the chunk rows into the tier (`land`) and
count as sealed from the start. So host DRAM = slots x page bytes + the bounded page cache. The window holds at
least max_rows x (LANDED_PAGES + 2) slots (`window_slots`). Shrink mode keeps a full-size mirror (PD lands P's
KV in it by pool page id through NIXL registration), so `build_engine(full_mirror=True)` ignores the knob and
builds a `SparseMirror` instead: one slot per page id at its pool address, backed by DRAM only where it holds
bytes; `seal` releases a page there too (its OS pages go back), so host DRAM = the landed, not yet sealed pages
+ each live request's tail page + the bounded page cache. An admission's warm start still reads the mirror (the
bytes just landed; sealing happens at the next step), so the decode thread waits on no disk read for it.
There SGLANG_PATHP_HOST_MIRROR_GB caps the pages of requests that have landed but wait to run (`queued`, a
`disk.queued.QueuedPages`): past the cap the queue's tail is parked in the tier on a worker, and a parked
request is read back into the mirror before it is admitted (the sglang layer holds it back meanwhile).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

import torch

from flashmemory.env import DiskTierConfig
from flashmemory.offload.disk import CorruptPageError, HostPageCache, disk_page_bytes, open_tier, pack_page
from flashmemory.offload.disk.format import pages_from_chunks
from flashmemory.offload.disk.queued import QueuedPages
from flashmemory.offload.disk.sparse_mirror import SparseMirror
from flashmemory.offload.engine import EngineConfig, OffloadEngine
from flashmemory.offload.layout import OffloadLayout
from flashmemory.offload.mirror import HostMirror
from flashmemory.offload.rows import RowState
from flashmemory.offload.sync import BatchSync, SyncResult
from flashmemory.offload.tiered_copy import TierCopy

log = logging.getLogger("flashmemory.offload.disk")
LANDED_PAGES = 1  # pages an admission lands in the window (its tail; complete pages go straight to the tier)
LAND_BATCH = 16  # complete pages packed per batch at admission (bounds the staging memory)

# stat key of `TieredEngine.tier_stats` -> what it counts (the sglang layer's /metrics reuses these keys)
TIER_STATS = (
    "disk_bytes_read",
    "disk_bytes_written",
    "disk_cache_hits",
    "disk_cache_misses",
    "disk_cache_hit_rate",
    "disk_recalls_waited",
    "disk_readahead_late",
    "disk_write_errors",
    "disk_pages_in_dram_pinned",
    "disk_corrupt_pages",
    "disk_decode_waits",
    "disk_write_waits",
    "disk_readahead_pages",
)


class TieredEngine(TierCopy, OffloadEngine):
    """An `OffloadEngine` whose sealed mirror pages are also held by `tier` (see the module doc).

    tier: a `HostPageCache` whose page_bytes is `disk_page_bytes(layout)`; the engine owns it from here on
    (`close` stops its readers and removes its store file). Keys are (str(rid), logical page).
    addressed: the mirror is written by page id from outside (shrink mode's PD landing): a `SparseMirror`.
    """

    def __init__(
        self,
        layout: OffloadLayout,
        cfg: EngineConfig,
        tier: HostPageCache,
        device: torch.device | str = "cpu",
        target_buffers: list[torch.Tensor] | None = None,
        addressed: bool = False,
    ):
        if tier.page_bytes != disk_page_bytes(layout):
            raise ValueError(
                f"TieredEngine: the tier's pages hold {tier.page_bytes} B, a mirror page {disk_page_bytes(layout)} B"
            )
        if addressed and cfg.mirror_slots:
            raise ValueError("TieredEngine: an addressed mirror keeps one slot per page id (mirror_slots must be 0)")
        self.addressed = addressed
        super().__init__(layout, cfg, device, target_buffers)
        self.tier = tier
        self.sealed: dict[int, tuple[int, int]] = {}  # row -> (gen, logical pages [0, n) put into the tier)
        self.recalls_waited = 0  # recall copies that waited for at least one disk read
        self.readahead_pages = 0  # reads queued when a cycle's selection named cold pages
        self.queued: QueuedPages | None = None  # shrink mode's DRAM cap on queued requests (`build_engine`)
        self.recaller.source = self

    def make_mirror(self, n_pages: int) -> HostMirror:
        """A `SparseMirror` when addressed (DRAM only for pages holding bytes), else the plain engine's mirror."""
        return SparseMirror(self.layout, n_pages) if self.addressed else super().make_mirror(n_pages)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def seal(self, skip: frozenset[int] | set[int] = frozenset()) -> int:
        """Put every live row's complete, not yet sealed pages into the tier (rows in `skip` left alone).
        Returns the pages sealed now. Runs under the engine lock (write-behind, if the cache overflows, too).
        With an addressed mirror a page the write queue has no room for stays in the mirror (its bytes are there)
        and is sealed at a later step, so the decode thread never waits for the writer."""
        pc, n = self.layout.page_chunks, 0
        with self.lock:
            for row, st in enumerate(self.rows):
                if st is None or row in skip:
                    continue
                gen, done = self.sealed.get(row, (st.gen, 0))
                done = done if gen == st.gen else 0
                upto = (st.n_chunks - 1) // pc  # pages before the newest chunk's page are complete
                rid = str(st.rid)
                p = done
                while p < upto:
                    data = pack_page(self.mirror, st.mpages[p])
                    if self.addressed and not self.tier.try_put(rid, p, data):
                        break
                    if not self.addressed:
                        self.tier.put(rid, p, data)
                    self.mirror.release([st.mpages[p]])  # the cache holds the bytes now (no-op at full size)
                    n += 1
                    p += 1
                self.sealed[row] = (st.gen, max(done, p))
        return n

    def land(self, row: int, st: RowState, m: torch.Tensor, kv: torch.Tensor, index: torch.Tensor | None) -> None:
        """Admission with a window: the tail page's chunks go to the mirror, the complete pages before it straight
        into the tier (packed from the chunk rows, LAND_BATCH pages at a time), sealed from the start. Without a
        window, the plain engine's write. Runs under the engine lock (inside `admit`)."""
        pc = self.layout.page_chunks
        head = (m.numel() - 1) // pc if self.mirror.slot_of is not None else 0  # the admission's chunks
        if head == 0:
            return super().land(row, st, m, kv, index)
        if index is None and self.layout.offload_index_layers:
            raise ValueError("TieredEngine: an admission into the landing window needs its Path-I index-K rows")
        t, rid = head * pc, str(st.rid)
        try:
            super().land(row, st, m[t:], kv[:, t:], None if index is None else index[:, t:])
            for p0 in range(0, head, LAND_BATCH):
                c0, c1 = p0 * pc, min(head, p0 + LAND_BATCH) * pc
                for i, data in enumerate(
                    pages_from_chunks(self.layout, kv[:, c0:c1], None if index is None else index[:, c0:c1])
                ):
                    self.tier.put(rid, p0 + i, data)
            self.mirror.release(st.mpages[:head])  # never had a slot: marked as the tier's (reading them raises)
        except BaseException:  # the admission fails whole: its pages, slots and tier pages go back
            self.mirror.free(st.mpages)
            self.tier.free_request(rid)
            raise
        self.sealed[row] = (st.gen, head)

    def sync_batch(self, sync: BatchSync) -> SyncResult:
        """The plain engine's step, sealing in `after_stores`. The calling thread is the decode thread: the tier
        counts its every wait on disk I/O (`disk_decode_waits`)."""
        self.tier.decode_thread = threading.get_ident()
        return super().sync_batch(sync)

    def after_stores(self, sync: BatchSync) -> None:
        """Seal the rows not finishing in this step, after the step's stores: a sealed page never changes again.
        A row whose admission has not reached the mirror yet (`landing`) is sealed once it has."""
        self.seal(skip=set(sync.finished) | self.landing_rows())

    def finish(self, row: int) -> None:
        """The plain finish, then the request's pages leave the host cache and the disk (space returns)."""
        with self.lock:
            rid = str(self._live(row).rid)
            super().finish(row)
            self.sealed.pop(row, None)
        self.tier.free_request(rid)

    def close(self) -> None:
        """Stop the queued-pages worker, the read-ahead threads, and remove this run's store file (idempotent)."""
        if self.queued is not None:
            self.queued.close()
        self.tier.close()
        self.tier.store.close()

    # ---- counters ------------------------------------------------------------------------------------
    def tier_stats(self) -> dict[str, float]:
        """The `TIER_STATS` (running totals, plus the hit-rate and pinned-page gauges)."""
        c = self.tier.counters
        return {
            "disk_bytes_read": float(c.disk_bytes_read),
            "disk_bytes_written": float(c.disk_bytes_written),
            "disk_cache_hits": float(c.cache_hits),
            "disk_cache_misses": float(c.cache_misses),
            "disk_cache_hit_rate": c.hit_rate,
            "disk_recalls_waited": float(self.recalls_waited),
            "disk_readahead_late": float(c.readahead_late),
            "disk_write_errors": float(c.write_errors),
            "disk_pages_in_dram_pinned": float(self.tier.pinned_pages),
            "disk_corrupt_pages": float(c.corrupt_pages),
            "disk_decode_waits": float(c.decode_disk_waits),
            "disk_write_waits": float(c.write_waits),
            "disk_readahead_pages": float(self.readahead_pages),
        }


def window_slots(disk: DiskTierConfig, layout: OffloadLayout, cfg: EngineConfig) -> int | None:
    """DRAM page slots of the host mirror's landing window: SGLANG_PATHP_HOST_MIRROR_GB // page bytes, at least
    max_rows x (LANDED_PAGES + 2) (a row holds its tail page plus the pages one step's appends open). None: no
    window (the knob is unset, or the window would hold every page anyway)."""
    want = disk.host_mirror_bytes
    if not disk.enabled or want is None:
        return None
    n_pages = cfg.mirror_pages or cfg.max_rows * layout.pages_for(cfg.max_chunks)
    slots = max(want // disk_page_bytes(layout), cfg.max_rows * (LANDED_PAGES + 2))
    return slots if slots < n_pages else None


def mirror_slot_count(layout: OffloadLayout, cfg: EngineConfig, disk: DiskTierConfig, full_mirror: bool = False) -> int:
    """DRAM page slots the host mirror of `build_engine(layout, cfg, ..., disk, full_mirror=...)` takes: the
    landing window's slots under the disk tier, else one per mirror page. With full_mirror (shrink mode's sparse
    mirror) SGLANG_PATHP_HOST_MIRROR_GB caps the queued requests' landed pages instead, the same number of pages
    (running requests' complete pages are sealed from their second step on)."""
    n_pages = cfg.mirror_pages or cfg.max_rows * layout.pages_for(cfg.max_chunks)
    if not disk.enabled:
        return cfg.mirror_slots or n_pages
    return cfg.mirror_slots or window_slots(disk, layout, cfg) or n_pages


def build_engine(
    layout: OffloadLayout,
    cfg: EngineConfig,
    device: torch.device | str,
    disk: DiskTierConfig,
    target_buffers: list[torch.Tensor] | None = None,
    rank: int = 0,
    full_mirror: bool = False,
) -> OffloadEngine:
    """The plain `OffloadEngine` when the disk tier is off; else a `TieredEngine` over `open_tier(disk, ...)`
    (which logs the tier's size and place, and the mirror's window). full_mirror: the caller addresses the
    mirror by page id from outside (shrink mode: PD lands there), so it keeps one slot per page whatever
    SGLANG_PATHP_HOST_MIRROR_GB says, and that knob caps the queued requests' landed pages (`QueuedPages`).
    Raises DiskTierError (one line) when the tier cannot start."""
    if not disk.enabled:
        return OffloadEngine(layout, cfg, device, target_buffers)
    if full_mirror and disk.host_mirror_bytes is not None:
        log.info(
            "disk tier: shrink mode: the host mirror spans every pool page id (PD lands there), sparse; "
            "SGLANG_PATHP_HOST_MIRROR_GB caps the landed pages of requests waiting to run at %d B "
            "(beyond it they wait in the tier and are read back before they run)",
            disk.host_mirror_bytes,
        )
    slots = cfg.mirror_slots or (None if full_mirror else window_slots(disk, layout, cfg))
    n_pages = cfg.mirror_pages or cfg.max_rows * layout.pages_for(cfg.max_chunks)
    tier = open_tier(disk, disk_page_bytes(layout), rank, window=(slots or n_pages, n_pages))
    try:
        eng = TieredEngine(
            layout,
            replace(cfg, mirror_slots=slots or 0),
            tier,
            device,
            target_buffers,
            addressed=full_mirror and not slots,
        )
        if isinstance(eng.mirror, SparseMirror) and disk.host_mirror_bytes is not None:
            eng.queued = QueuedPages(eng.mirror, tier, layout, disk.host_mirror_bytes, eng.lock)
        return eng
    except BaseException:
        tier.close()
        tier.store.close()
        raise


def engine_tier(engine: Any) -> TieredEngine | None:
    """The engine if it carries a disk tier, else None."""
    return engine if isinstance(engine, TieredEngine) else None


def dist_rank() -> int:
    """This process's rank (each rank opens its own page store file); 0 outside torch.distributed."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def corrupt_page_in(e: BaseException) -> CorruptPageError | None:
    """The `CorruptPageError` in `e`'s cause chain (a recall read a page that failed verification), or None."""
    cur: BaseException | None = e
    for _ in range(16):
        if cur is None or isinstance(cur, CorruptPageError):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None
