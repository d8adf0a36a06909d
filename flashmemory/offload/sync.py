"""One decode step's request lifecycle as plain data, applied by `OffloadEngine.sync_batch` in one call.

A host driver (the sglang adapter) describes the step: bytes of chunks it already appended that its storage
now holds (`ChunkStore`), rows to finish, then per batch row (in batch order) an admission and/or mirror pages
to add, then rounds of decode appends (one chunk per listed row per round). The engine applies them in exactly
that order, the order of the separate calls (`store_chunks`, `finish`, `admit`, `open_tail_page`, warm start,
`add_pages`, `decode_append`), so reserve blocks, lookup table and resident tables come out identical.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ChunkStore:
    """Bytes the caller's storage holds for mirror chunks m int64 [n] (on the core's device) of rows still
    admitted, for c4 `layers`: kv uint8 [len(layers), n, kv_chunk_bytes] or None; index[j] uint8 [n,
    index_chunk_bytes] of layer `layers[j]` or None. What `store_chunks` takes; in a `BatchSync` it is applied
    before anything else (copy mode's settle of last step's appends, read from sglang's pool), so a page the
    disk tier seals in the same step already holds these bytes. With `rows` (engine row per chunk; m on the host,
    every layer, kv and index where the reserve lives) it is staged instead (`stage_chunks`: no host wait; the
    disk tier seals a row only once its staged bytes are in the mirror)."""

    m: torch.Tensor
    layers: tuple[int, ...]
    kv: torch.Tensor | None = None
    index: tuple[torch.Tensor | None, ...] | None = None
    rows: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Admission:
    """A new request in `row` with n_chunks of history. kv / index: uint8 [n_layers, n_chunks, chunk bytes] to
    write (copy mode), or None with `mpages` (mirror pages, logical order) that already hold the bytes (shrink
    mode). Its newest page is made resident at once; warm_pages > 0 then recalls its newest warm_pages pages
    (a recency-tail warm start, not a Level-1 cycle)."""

    row: int
    rid: Hashable
    n_chunks: int
    kv: torch.Tensor | None = None
    index: torch.Tensor | None = None
    mpages: tuple[int, ...] | None = None
    warm_pages: int = 0


@dataclass(frozen=True)
class RowSync:
    """One batch row: `admit` if it is new this step; `add_pages`: mirror pages to claim and append (shrink)."""

    row: int
    admit: Admission | None = None
    add_pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class AppendRound:
    """One `decode_append`: rows [n] each get one chunk; kv / index: [n_layers, n, chunk bytes] or None (the
    caller's store kernel writes the cells)."""

    rows: tuple[int, ...]
    kv: torch.Tensor | None = None
    index: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchSync:
    """batch: the step's engine row per batch position (-1: none), in batch order; the result carries their
    resident pages as they stand after the sync (None: not read). stores: applied first (None: nothing)."""

    finished: tuple[int, ...] = ()
    rows: tuple[RowSync, ...] = ()
    appends: tuple[AppendRound, ...] = ()
    batch: tuple[int, ...] | None = None
    stores: ChunkStore | None = None


@dataclass(frozen=True)
class SyncResult:
    """cells: per append round, int64 [len(rows)] reserve cells written; mpages: mirror pages (logical order)
    and n_chunks: history length of every row in `BatchSync.rows` after the sync; resident: int64 [len(batch),
    max_resident_pages + decode_pages] resident logical pages of `BatchSync.batch` (`resident_pages`), None when
    no batch was given; unplanned: per `BatchSync.batch` row, its request's first Level-1 plan has not published
    (resident by its warm start alone; False for row -1), read in the same hold of the lock as `resident`."""

    cells: tuple[torch.Tensor, ...] = ()
    mpages: dict[int, tuple[int, ...]] = field(default_factory=dict)
    n_chunks: dict[int, int] = field(default_factory=dict)
    resident: torch.Tensor | None = None
    unplanned: tuple[bool, ...] = ()


@dataclass(frozen=True)
class StagedSettle:
    """A settle on its way to the host mirror (`CoreAccess.stage_settle`): mirror chunks m int64 [n] (host),
    their kv uint8 [n_layers, n, kv_chunk_bytes] and Path-I index-K [n_path_i_layers, n, index_chunk_bytes] (or
    None) in pinned host buffers, filled by a device copy that `done` (a CUDA event) marks complete; kv None:
    nothing left to write (settled at once, without streams)."""

    m: torch.Tensor
    kv: torch.Tensor | None
    index: torch.Tensor | None
    done: Any
