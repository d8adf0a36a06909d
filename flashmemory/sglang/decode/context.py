"""The two lifetimes of FlashMemory state in an sglang scheduler process, apart from the process object itself
(`runtime.Runtime`): what one forward uses and drops (`ForwardContext`), and the HiSparse modes' share of the
process state (`HiSparseState`, a field of the process object).

`ForwardContext` is built by `Runtime.before_forward` for each forward and read by the hooks that run inside
it; nothing in it outlives the next forward. Static buffers a CUDA graph bakes in never live here (they are
allocated once per process: the side band, the Level-2 buffers).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardContext:
    """Scratch of one forward: what one hook leaves for a later hook of the same forward. The batch's rows,
    lengths and positions stay on sglang's forward batch, which every hook is handed; the side band's captured
    inputs stay in the static side band (a CUDA graph writes them in place).

    decode_active: the mode of the latest C4-indexer call (True in decode). A new forward's context starts with
      the previous one's value, which holds until its own first indexer call sets it (index-K reads before that
      call keep reading what they read before).
    mask_resident: bool [rows, pages] resident set, set around one indexer call in mask mode.
    attn_layer: the c4 layer whose attention is running (its c4 KV reads go to the reserve), else None.
    view_cache / block_view_cache: (indexer metadata, c4 layer that built it, resident view): the score-resident
      view built by the first c4 layer and reused by the later ones (the block view: its Path-I reserve form).
    keep_alive: translated store locs (int64) whose kernels may still run on another stream in this forward.
    pool_rows: bool [B] on the device, the rows that attend their whole c4 history from sglang's pool in this
      forward (copy mode, before their request's first Level-1 plan: `Runtime.pool_rows`); None: every row
      reads the reserve.
    """

    decode_active: bool = False
    mask_resident: torch.Tensor | None = None
    attn_layer: int | None = None
    view_cache: tuple[Any, int, Any] | None = None
    block_view_cache: tuple[Any, int, Any] | None = None
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    pool_rows: torch.Tensor | None = None

    def next(self) -> "ForwardContext":
        """The context of the forward after this one (carries only `decode_active`, see above)."""
        return ForwardContext(decode_active=self.decode_active)


@dataclass
class HiSparseState:
    """What the HiSparse modes keep for the whole process; each part is created by the module that owns it.

    swapin: `cpu.hisparse_record.SwapInCounter`, the CPU swap-in totals (created on first use).
    trace_path: FLASHMEMORY_HISPARSE_TRACE, read once ("" = no trace; None = not read yet).
    trace_layers: data_ptr of a c4 layer's hot buffer -> its index, in order of first swap-in (guarded by
      trace_lock, which also serialises the trace file's appends).
    newest_pending: request slot -> (c4 entries that came with its prefill, data_ptrs of the c4 layers whose
      reserved slot is not loaded yet) (`cpu.patches_hisparse.admit_direct`).
    prefetch: `state.PrefetchState`, the prefetch mode's buffers and counters (created on first use).
    hint: `hint.HintSource` when Level 1 is the prefetch hint source, else None.
    """

    swapin: Any = None
    trace_path: str | None = None
    trace_layers: dict[int, int] = field(default_factory=dict)
    trace_lock: threading.Lock = field(default_factory=threading.Lock)
    newest_pending: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    prefetch: Any = None
    hint: Any = None
