"""The disk tier: c4 KV pages (+ Path-I index-K pages) of the host mirror on local
disk, below a bounded host-DRAM page cache, recalled ahead of need within Level 1's tau window.

Three tiers: device reserve <- host page cache (`HostPageCache`, LRU, write-behind, read-ahead on a worker)
<- page store (`PageStore`, one checksummed, page-aligned file per rank, O_DIRECT where allowed). Wired under the
engine by `flashmemory.offload.tiered_mirror` (`TieredEngine`, built by `build_engine` when the tier is on);
`flashmemory bench tier` measures it.
Configuration: `flashmemory.env.DiskTierConfig` (SGLANG_PATHP_DISK_DIR, _DISK_GB, _HOST_CACHE_GB).
A store is alive while its file lock is held (`store`); this process's stores are removed at SIGTERM, SIGINT and
exit (`owned`), a killed one's by the next store that opens in the same directory.
"""

import logging

from flashmemory.env import DiskTierConfig
from flashmemory.offload.disk.cache import HostPageCache
from flashmemory.offload.disk.faults import FaultPlan, FaultyFileOps
from flashmemory.offload.disk.fileops import ALIGN, FileOps, OsFileOps
from flashmemory.offload.disk.format import disk_page_bytes, pack_page, unpack_page
from flashmemory.offload.disk.store import CorruptPageError, DiskTierError, PageStore, remove_stale_stores
from flashmemory.offload.disk.writer import DiskTierCounters

__all__ = [
    "DiskTierCounters",
    "HostPageCache",
    "FaultPlan",
    "FaultyFileOps",
    "ALIGN",
    "FileOps",
    "OsFileOps",
    "disk_page_bytes",
    "pack_page",
    "unpack_page",
    "CorruptPageError",
    "DiskTierError",
    "PageStore",
    "remove_stale_stores",
    "open_tier",
]


def open_tier(
    cfg: DiskTierConfig, page_bytes: int, rank: int = 0, readers: int = 4, window: tuple[int, int] | None = None
) -> HostPageCache:
    """The store + cache a rank gets from its `DiskTierConfig`; logs the tier's size and where it lives, and with
    `window` = (DRAM page slots, page ids) the host mirror's landing window (SGLANG_PATHP_HOST_MIRROR_GB).
    Raises DiskTierError (one line naming the variable) when the directory or the sizes cannot work."""
    if not cfg.enabled:
        raise DiskTierError("disk tier: SGLANG_PATHP_DISK_DIR is not set")
    store = PageStore(cfg.dir, cfg.disk_bytes, page_bytes, rank=rank)
    try:
        cache = HostPageCache(store, cfg.host_cache_bytes, readers=readers)
    except BaseException:
        store.close()
        raise
    if window is None:
        mirror = ""
    elif window[0] < window[1]:
        mirror = (
            f", host mirror landing window {window[0]} of {window[1]} page slots ({window[0] * page_bytes / 1e9:.3g}"
            f" of {window[1] * page_bytes / 1e9:.3g} GB)"
        )
    else:
        mirror = f", host mirror full size ({window[1]} pages, {window[1] * page_bytes / 1e9:.3g} GB)"
    logging.getLogger("flashmemory.offload.disk").info(
        "disk tier (rank %d): %d pages of %d B on disk at %s (%.3g GB, %s), host cache %d pages (%.3g GB)%s",
        rank,
        store.n_slots,
        page_bytes,
        store.path,
        store.n_slots * store.slot_bytes / 1e9,
        "O_DIRECT" if store.direct else "buffered",
        cache.capacity_pages,
        cache.capacity_pages * page_bytes / 1e9,
        mirror,
    )
    return cache
