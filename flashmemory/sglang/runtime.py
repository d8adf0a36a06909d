"""Process-wide FlashMemory state inside one sglang scheduler process, and the offload-core contract.

The hooks (`hooks.py`) are thin: they pull tensors off sglang objects and call into `RUNTIME`. The
engine-agnostic offload core (`flashmemory.offload`) provides the object behind `OffloadEngine`; this
module only drives it. Static buffers live here so the decode CUDA graph can bake them in.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flashmemory.env import FlashMemoryEnv

logger = logging.getLogger(__name__)


class OffloadEngine(Protocol):
    """What the sglang glue needs from the offload core (`flashmemory.offload`). Shapes per c4 layer l:

    resident_mask   Bool [n_locs]        pool loc -> resident (mask mode; layer-uniform)
    lut             Int32 [n_locs + 1]   pool loc -> reserve cell, -1 = not resident, last entry -1
    reserve_kv(l)   uint8 [cells/64, 37440] device reserve rows read by attention instead of the c4 pool
    reserve_index(l) uint8 [blocks, 8448] or None   Path-I reserve for non-target index-K
    """

    resident_mask: torch.Tensor
    lut: torch.Tensor

    def reserve_kv(self, layer: int) -> torch.Tensor: ...
    def reserve_index(self, layer: int) -> torch.Tensor | None: ...
    def on_c4_store(self, layer: int, locs: torch.Tensor) -> None: ...
    def on_index_store(self, layer: int, locs: torch.Tensor) -> None: ...
    def mirror_buf_infos(self) -> dict[int, tuple[int, int, int]]: ...
    def level1(self, snapshot: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def stats(self) -> dict[str, float]: ...


def build_engine(pool: Any, env: FlashMemoryEnv) -> OffloadEngine:
    """Create the offload core for an sglang DSv4 pool. Raises RuntimeError naming what is missing."""
    try:
        from flashmemory.offload import sglang_engine  # the core's sglang-facing constructor
    except ImportError as e:
        raise RuntimeError(
            "SGLANG_DECODE_SWAP_P=1 needs flashmemory.offload.sglang_engine.build(pool, env) from the offload "
            f"core, which is not available ({e}); turn the gate off or install the core") from None
    return sglang_engine.build(pool, env)


def substitute_buf_infos(infos: tuple[list[int], list[int], list[int]],
                         mirror: dict[int, tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
    """PD receive into the host mirror: replace (ptr, len, item_len) entries whose device ptr is a key of `mirror`."""
    ptrs, lens, items = (list(x) for x in infos)
    for i, p in enumerate(ptrs):
        if p in mirror:
            ptrs[i], lens[i], items[i] = mirror[p]
    return ptrs, lens, items


@dataclass
class Level2Buffers:
    """Static per-row residency for score-resident mode: front (read by the graph) and back (side band)."""

    sel_pages: torch.Tensor      # [max_bs, K] int64 ascending, -1 padded
    back_pages: torch.Tensor
    rids: list[str | None]

    @classmethod
    def allocate(cls, max_bs: int, kmax: int, device: torch.device | str) -> "Level2Buffers":
        z = torch.full((max_bs, kmax), -1, dtype=torch.int64, device=device)
        return cls(z, z.clone(), [None] * max_bs)

    def reset_rows(self, rows: list[int]) -> None:
        if rows:
            self.sel_pages[rows] = -1

    def publish(self) -> None:
        """Copy the side band's back buffer to the front, on the caller's (main) stream, between forwards."""
        self.sel_pages.copy_(self.back_pages)


class Runtime:
    """State for one scheduler process; `configure` is called by `plugin.register`."""

    def __init__(self) -> None:
        self.env = FlashMemoryEnv()
        self.features: tuple[str, ...] = ()
        self.pool: Any = None
        self.engine: OffloadEngine | None = None
        self.bufs: Level2Buffers | None = None
        self.dump = None
        self.metrics = None
        self.mask_resident: torch.Tensor | None = None   # set around one indexer call in mask mode
        self.decode_active = False
        self.sideband_inputs: dict[str, torch.Tensor] = {}
        self._worker: threading.Thread | None = None
        self._result: dict[str, torch.Tensor] | None = None
        self._rs_cache: tuple[int, Any] | None = None
        self.steps = 0

    def configure(self, env: FlashMemoryEnv, features: tuple[str, ...]) -> None:
        self.env, self.features = env, features
        if "dump" in features:
            from flashmemory.sglang.dump_mode import DumpRecorder
            self.dump = DumpRecorder()

    def on(self, feature: str) -> bool:
        return feature in self.features

    # --- memory pool ------------------------------------------------------------------------------
    def attach_pool(self, pool: Any) -> None:
        if getattr(pool, "is_draft_worker", False) or self.pool is not None:
            return
        self.pool = pool
        if self.on("path_p"):
            self.engine = build_engine(pool, self.env)
            from flashmemory.sglang.metrics import FlashMemoryMetrics
            self.metrics = FlashMemoryMetrics.create()
            logger.info("FlashMemory: offload engine attached to %s", type(pool).__name__)

    def c4_layer(self, pool: Any, layer_id: int) -> int | None:
        """c4 ordinal of a model layer, None for non-c4 layers."""
        ratio, compress_layer_id, _ = pool.layer_mapping[layer_id][:3]
        return compress_layer_id if ratio == 4 else None

    # --- side band (Level 1) -----------------------------------------------------------------------
    def capture_sideband_input(self, layer: int, x: torch.Tensor, positions: torch.Tensor,
                               page_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        d = self.sideband_inputs
        d[f"hidden_{layer}"] = x.detach()
        d["positions"], d["page_table"], d["seq_lens"] = positions, page_table, seq_lens

    def before_forward(self, forward_batch: Any) -> None:
        """Apply a finished Level-1 publication, and forget residency of rows whose request changed."""
        if self.bufs is None:
            return
        if self._worker is not None and not self._worker.is_alive():
            self._worker = None
            if self._result is not None:
                self.bufs.back_pages.copy_(self._result["pages"].to(self.bufs.back_pages.device))
                self.bufs.publish()
                self._result = None
        rids = list(getattr(forward_batch, "rids", None) or [])
        changed = [i for i, r in enumerate(rids[: len(self.bufs.rids)]) if self.bufs.rids[i] != r]
        if changed:
            self.bufs.reset_rows(changed)
            for i in changed:
                self.bufs.rids[i] = rids[i]

    def after_decode_forward(self, forward_batch: Any) -> None:
        """Launch a Level-1 cycle on a worker thread (side CUDA stream) every `interval` steps."""
        self.steps += 1
        if self.engine is None or not self.sideband_inputs or self.steps % self.env.interval:
            return
        if self._worker is not None:
            if not self.env.async_recall:
                self._worker.join()
            else:
                return  # previous cycle still running: skip, never queue
        snapshot = {k: v.clone() for k, v in self.sideband_inputs.items()}
        engine = self.engine

        def work() -> None:
            stream = torch.cuda.Stream() if torch.cuda.is_available() else None
            if stream is not None:
                with torch.cuda.stream(stream):
                    res = engine.level1(snapshot)
                stream.synchronize()
            else:
                res = engine.level1(snapshot)
            self._result = res

        self._worker = threading.Thread(target=work, name="flashmemory-level1", daemon=True)
        self._worker.start()
        if not self.env.async_recall:
            self._worker.join()
        if self.metrics is not None:
            self.metrics.publish(engine.stats())


RUNTIME = Runtime()
