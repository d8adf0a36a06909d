"""The disk tier's variables (`flashmemory.offload.disk`): where each rank's page store lives and how large it, the
host page cache in front of it and the host mirror's landing window may grow."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from flashmemory.env_values import EnvError, read_float

MAX_DISK_GB = float(1 << 20)  # 1 PB of page store per rank: a larger value is a typo
MAX_HOST_CACHE_GB = float(1 << 14)  # 16 TB of host page cache per rank


@dataclass(frozen=True)
class DiskTierConfig:
    """The disk tier below the host mirror: where each rank's page store lives and how big it and the
    host-DRAM page cache in front of it may grow. `enabled` iff `dir` is set.

    dir: SGLANG_PATHP_DISK_DIR, an absolute directory ("" = no disk tier); each rank creates its own uniquely named
    store file there. disk_gb: SGLANG_PATHP_DISK_GB, the store's size bound per rank (GB = 1e9 B). host_cache_gb:
    SGLANG_PATHP_HOST_CACHE_GB, the host page cache per rank (GB = 1e9 B). host_mirror_gb:
    SGLANG_PATHP_HOST_MIRROR_GB, the host mirror's landing window per rank (GB = 1e9 B; 0 = unset: full size).
    """

    dir: str = ""
    disk_gb: float = 64.0
    host_cache_gb: float = 8.0
    host_mirror_gb: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.dir)

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_gb * 1e9)

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gb * 1e9)

    @property
    def host_mirror_bytes(self) -> int | None:
        """The landing window's DRAM in bytes, or None (unset: the mirror keeps one slot per page)."""
        return int(self.host_mirror_gb * 1e9) if self.host_mirror_gb > 0 else None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "DiskTierConfig":
        e = os.environ if env is None else env
        d = cls()
        out = cls(
            dir=(e.get("SGLANG_PATHP_DISK_DIR") or "").strip(),
            disk_gb=read_float(e, "SGLANG_PATHP_DISK_GB", d.disk_gb, 0.0, MAX_DISK_GB),
            host_cache_gb=read_float(e, "SGLANG_PATHP_HOST_CACHE_GB", d.host_cache_gb, 0.0, MAX_HOST_CACHE_GB),
            host_mirror_gb=read_float(e, "SGLANG_PATHP_HOST_MIRROR_GB", d.host_mirror_gb, 0.0, MAX_HOST_CACHE_GB),
        )
        if out.dir and not os.path.isabs(out.dir):
            raise EnvError(f"SGLANG_PATHP_DISK_DIR={out.dir!r}: must be an absolute directory")
        mirror_set = bool((e.get("SGLANG_PATHP_HOST_MIRROR_GB") or "").strip())
        for name, v in (
            ("SGLANG_PATHP_DISK_GB", out.disk_gb),
            ("SGLANG_PATHP_HOST_CACHE_GB", out.host_cache_gb),
            ("SGLANG_PATHP_HOST_MIRROR_GB", out.host_mirror_gb if mirror_set else 1.0),
        ):
            if v <= 0:
                raise EnvError(f"{name}={v}: must be > 0")
            if not out.dir and (e.get(name) or "").strip():
                raise EnvError(
                    f"{name} is set but SGLANG_PATHP_DISK_DIR is not: the disk tier is off without a "
                    "directory (set SGLANG_PATHP_DISK_DIR=/abs/dir or unset " + name + ")"
                )
        return out
