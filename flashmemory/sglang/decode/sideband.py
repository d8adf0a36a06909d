"""Static side-band buffers that carry the Level-1 inputs out of the decode forward, CUDA graph or not.

Under `SGLANG_PATHP_CUDAGRAPH=1` (and any captured decode) the indexer hook's Python runs only while the graph is
captured; on replay only the recorded device ops run. Level 1 therefore must not keep a Python reference to a
forward-time tensor (the capture-time `x` lives in the graph's private pool and is reused by later ops of the
same graph). Instead, each target c4 layer's indexer hook records an in-place `copy_` into buffers allocated
before capture; replay re-executes that copy every step, and Level 1 reads the buffers after the forward.
Eager decode uses the very same path.

Buffers (max_bs = `capacity`):
  hidden[l]   [max_bs, hidden]  dtype of x   indexer-input hidden states of target c4 layer l, rows [:B] this step
  positions   [max_bs]          int64        token positions of the rows
  q_lora[l]   [max_bs, rank]    dtype of it  the indexer's q_lora input of target layer l (only with the miss
                                             monitor, SGLANG_RETRIEVER_MISS_MONITOR: it recomputes the native query)
  written     [n_target]        int64        rows each target layer wrote in the current forward (0 = hook did
                                             not run: stale data); zeroed by `begin_forward` before each forward
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flashmemory.offload import streams


class SidebandError(RuntimeError):
    """The side band cannot take this forward's inputs without a (capture-illegal) reallocation."""


@dataclass
class SidebandBuffers:
    layers: tuple[int, ...]  # target c4 layers, in the order of `written`
    hidden: dict[int, torch.Tensor]  # layer -> [capacity, hidden]
    positions: torch.Tensor  # [capacity] int64
    written: torch.Tensor  # [len(layers)] int64
    q_lora: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [capacity, rank] (miss monitor only)

    @classmethod
    def allocate(
        cls,
        layers: tuple[int, ...],
        capacity: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device | str,
        q_lora_rank: int = 0,
        q_lora_dtype: torch.dtype | None = None,
    ) -> "SidebandBuffers":
        """Zero-filled buffers for `capacity` rows (q_lora ones only when q_lora_rank > 0). Call outside capture."""
        ql = (
            {l: torch.zeros(capacity, q_lora_rank, dtype=q_lora_dtype or dtype, device=device) for l in layers}
            if q_lora_rank > 0
            else {}
        )
        return cls(
            tuple(layers),
            {l: torch.zeros(capacity, hidden, dtype=dtype, device=device) for l in layers},
            torch.zeros(capacity, dtype=torch.int64, device=device),
            torch.zeros(len(layers), dtype=torch.int64, device=device),
            ql,
        )

    @property
    def capacity(self) -> int:
        return self.positions.shape[0]

    def accepts(self, layer: int, x: torch.Tensor) -> bool:
        """Whether `write(layer, x, ...)` can run without reallocation (shape / dtype / device only, no sync)."""
        buf = self.hidden.get(layer)
        return (
            buf is not None
            and x.dim() == 2
            and x.shape[1] == buf.shape[1]
            and x.dtype == buf.dtype
            and x.device == buf.device
        )

    def accepts_q_lora(self, layer: int, q_lora: torch.Tensor | None) -> bool:
        """q_lora [B, rank] fits this layer's q_lora buffer (True when none is kept and none is given)."""
        buf = self.q_lora.get(layer)
        if buf is None or q_lora is None:
            return buf is None
        return q_lora.dim() == 2 and q_lora.shape[1] == buf.shape[1] and q_lora.dtype == buf.dtype

    def write(
        self,
        layer: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        q_lora: torch.Tensor | None = None,
        q_lora_ready: Any = None,
    ) -> None:
        """Record this layer's inputs: x [B, hidden], positions [>= B] (any int dtype). CUDA-graph safe.

        Only static-shape in-place device ops (`copy_`, `fill_` with a Python int taken from shapes): no host
        sync, no allocation, no branch on tensor values. Rows [B:] (graph padding beyond capacity, or rows of an
        earlier, larger batch) are left untouched; readers take only the real rows.
        q_lora_ready: the event DeepSeek-V4 records on the forward stream once q_lora is computed (its indexer,
        and this hook, run on `stream_indexer`, forked before q_lora exists); the copy waits on it (a stream wait,
        legal under capture, as sglang's own indexer does), after x and positions are taken."""
        n = min(x.shape[0], self.capacity, positions.reshape(-1).shape[0])
        self.hidden[layer][:n].copy_(x[:n])
        self.positions[:n].copy_(positions.reshape(-1)[:n])
        if q_lora is not None and layer in self.q_lora:
            if q_lora_ready is not None:
                torch.cuda.current_stream().wait_event(q_lora_ready)
            self.q_lora[layer][:n].copy_(q_lora[:n])
        self.written[self.layers.index(layer)].fill_(n)

    def begin_forward(self) -> None:
        """Mark every layer stale before a forward (eager, on the main stream, ordered before the replay)."""
        self.written.zero_()

    def read(self, n_rows: int) -> dict[str, torch.Tensor]:
        """Views of the first min(n_rows, capacity) rows: {"hidden_{l}": [n, hidden], "positions": [n]}.

        Views, not copies: valid until the next forward overwrites the buffers, so the reader must take what it
        keeps (Level 1's `index_select` + `clone`) on the main stream before that forward is launched."""
        n = min(n_rows, self.capacity)
        out = {f"hidden_{l}": buf[:n] for l, buf in self.hidden.items()}
        out.update({f"q_lora_{l}": buf[:n] for l, buf in self.q_lora.items()})
        out["positions"] = self.positions[:n]
        return out

    def stale_layers(self, n_rows: int, written: torch.Tensor | None = None) -> list[int]:
        """Target layers that wrote fewer than min(n_rows, capacity) rows: in `written` (a host copy taken by
        `stage_written`), or else in this forward's counts (a host sync on a device)."""
        need = min(n_rows, self.capacity)
        got = (self.written if written is None else written).tolist()
        return [l for l, w in zip(self.layers, got) if w < need]

    def stage_written(self) -> tuple[torch.Tensor, Any]:
        """This forward's `written` on its way to the host without a wait: (int64 [n_target] host tensor, a CUDA
        event marking its copy, or None when it is already there). On a stream device the counts are copied into
        page-locked memory with non_blocking=True on the current stream, after the forward enqueued there."""
        if not (streams.is_device(self.written) and streams.streams_on(self.written.device)):
            return self.written.clone(), None
        host = streams.pinned_empty(tuple(self.written.shape), self.written.dtype)
        host.copy_(self.written, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done
