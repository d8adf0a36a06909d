"""Where the offload core's device work is ordered: the forward stream, the recall side stream, the forward gate.

sglang enqueues decode forwards on a stream of its own (`ModelRunner.forward_stream` under the overlap scheduler,
the scheduler's `schedule_stream` without it; DeepSeek-V4's indexer forks onto `stream_indexer` and joins back
inside the forward). The core therefore never remembers a stream from construction: the decode thread hands the
stream its next forward runs on to `begin_forward` at every step, and every lookup-table / resident-table write
and every recall fence is issued against that stream.

The gate is what makes another thread's writes land *between* two forwards rather than inside one: the decode
thread holds it from `begin_forward` (before it enqueues a forward) to `end_forward` (after), and the Level-1
worker takes it (`between_forwards`) around its table writes. So a forward sees either the old or the new
tables in all its layers, a victim's entries are cleared before the next forward is enqueued, and a recall copy
that waits on the forward stream after that clear waits for every forward that could still read the victim.
Lock order: the gate before the engine lock, everywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch


def streams_on(device: torch.device) -> bool:
    """Whether work on `device` is ordered by CUDA streams (the test stand-in `tests/support/cuda_standin.py`
    replaces this to drive the stream logic on CPU tensors)."""
    return device.type == "cuda"


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory: an H2D copy from it (or a D2H copy into it) with non_blocking=True does not make
    the host wait. torch's pinned allocator keeps a freed block until the copies that used it are complete, so a
    buffer dropped right after its copy is enqueued is safe. (The stand-in replaces this on CPU.)"""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def is_device(t: torch.Tensor) -> bool:
    """Whether `t` lives in device memory (the stand-in tells its device-standing CPU tensors apart)."""
    return t.device.type != "cpu"


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: on a stream device it is staged in pinned memory
    and copied with non_blocking=True on the current stream (work enqueued there afterwards sees it); elsewhere
    `.to(device)`."""
    device = torch.device(device)
    if not streams_on(device):
        return host.to(device)
    buf = pinned_empty(tuple(host.shape), host.dtype)
    buf.copy_(host)
    return buf.to(device, non_blocking=True)


def download(t: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned host copy of device tensor `t` enqueued on the current stream with non_blocking=True (the host does
    not wait): its bytes are valid once an event recorded after it on that stream has completed. None for None."""
    if t is None:
        return None
    host = pinned_empty(tuple(t.shape), t.dtype)
    host.copy_(t, non_blocking=True)
    return host


def like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`t` where `ref` lives: a host tensor for a device `ref` goes up through `upload` (no host wait); a device
    tensor for a host `ref` comes down with `.cpu()` (a host read: the caller means it); else `t` itself."""
    if is_device(ref) and not is_device(t):
        return upload(t, ref.device)
    if is_device(t) and not is_device(ref):
        return t.cpu()
    return t


class ForwardOrder:
    """The forward stream handed in per step, the side stream recalls copy on, and the forward gate (an RLock
    owned by the decode thread while it enqueues a forward). Without streams (CPU) only the gate does anything."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.enabled = streams_on(self.device)
        self.side: Any = torch.cuda.Stream(self.device) if self.enabled else None
        self._stream: Any = None
        self._gate = threading.RLock()
        self._owner: int | None = None

    @property
    def stream(self) -> Any:
        """The stream decode forwards run on, as last handed to `begin_forward`; before the first forward, the
        calling thread's current stream (no forward reads anything yet). None without streams."""
        if not self.enabled:
            return None
        return self._stream if self._stream is not None else torch.cuda.current_stream(self.device)

    def begin_forward(self, stream: Any = None) -> None:
        """Decode thread, before it enqueues a forward: take the gate (kept until `end_forward`; a second call
        without one in between keeps it) and `stream` (default: this thread's current stream) as the forward
        stream."""
        me = threading.get_ident()
        if self._owner != me:
            self._gate.acquire()
            self._owner = me
        if self.enabled:
            self._stream = stream if stream is not None else torch.cuda.current_stream(self.device)

    def end_forward(self) -> None:
        """Decode thread, once the forward is enqueued: release the gate (no-op when this thread does not hold it)."""
        if self._owner == threading.get_ident():
            self._owner = None
            self._gate.release()

    def on_stream(self) -> Any:
        """Context: device work issued inside goes to the forward stream (no-op without streams)."""
        return torch.cuda.stream(self.stream) if self.enabled else nullcontext()

    @contextmanager
    def between_forwards(self) -> Iterator[None]:
        """Context for table writes from any thread: waits while a forward is being enqueued (the decode thread's
        own calls pass: the gate is reentrant) and issues the work on the forward stream. Take it before the
        engine lock."""
        with self._gate, self.on_stream():
            yield

    def set_device(self) -> None:
        """Make this thread's current device the core's (a worker thread starts on device 0 otherwise)."""
        if self.enabled and not (self.device.type == "cuda" and self.device.index is None):
            torch.cuda.set_device(self.device)

    def copy_context(self) -> Any:
        """Context for a recall copy: the side stream, after it waits for all work enqueued on the forward stream
        so far (every forward that may still read a victim's old bytes: victims leave the tables, between
        forwards, before any copy is planned). No-op without streams."""
        if not self.enabled:
            return nullcontext()
        self.side.wait_stream(self.stream)
        return torch.cuda.stream(self.side)
