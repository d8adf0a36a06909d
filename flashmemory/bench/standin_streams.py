"""A recording stand-in for `torch.cuda`'s streams, events and devices (the ordering half of the stand-in).

What only a GPU shows (which stream an op is enqueued on, which waits order it, which device a thread runs on) is
proven on CPU tensors with it: `install(setattr)` replaces `torch.cuda.{Stream, Event, current_stream,
default_stream, stream, set_device, current_device, synchronize}` with recording versions and makes the offload
core treat the CPU as a stream device (`flashmemory.offload.streams.streams_on`). Tensors stay on the CPU; ops
run at once; the stand-in only keeps the order a GPU would enforce. Its host syncs are also counted as blocking
operations (`standin_blocking.record`).

Happens-before is tracked with vector clocks. Every stream has a clock {stream id: ops}; an op logged on stream S
(`StandIn.op`) takes S's next sequence number and a snapshot of S's clock. `wait_stream` / `wait_event` merge the
waited clock into the waiter's; `Event.record` snapshots the recording stream's clock. A host sync
(`Stream.synchronize`, `Event.synchronize`, `torch.cuda.synchronize`) makes what it waited for complete in real
time, so every op enqueued afterwards, on any stream by any thread, happens after it. `hb(a, b)`: op a is
complete before op b can start on a real device. `query()` of a stream or event answers True (a CPU op is done).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from flashmemory.bench.standin_blocking import pinned, record

Clock = dict[int, int]


def _merge(a: Clock, b: Clock) -> None:
    for k, v in b.items():
        if a.get(k, 0) < v:
            a[k] = v


@dataclass(frozen=True)
class Op:
    """One logged device op: `seq` on stream `stream` (its id), `clock` the stream's clock when it was enqueued."""

    index: int  # position in the host-order log
    stream: int
    stream_name: str
    seq: int
    clock: tuple[tuple[int, int], ...]
    kind: str  # "read" / "write"
    resource: Hashable
    thread: str

    def after(self, other: "Op") -> bool:
        """`other` happens before this op."""
        return dict(self.clock).get(other.stream, 0) >= other.seq


@dataclass
class StandIn:
    """The recording state: streams, the host-completed clock, the op log and per-thread current stream/device."""

    log: list[Op] = field(default_factory=list)
    devices: list[tuple[str, Any]] = field(default_factory=list)  # (thread name, device) per set_device
    host_syncs: list[tuple[str, str]] = field(default_factory=list)  # (thread name, what) per host sync
    calls: list[tuple[str, str]] = field(default_factory=list)  # (thread name, torch.cuda name) per call
    done: Clock = field(default_factory=dict)
    _mu: threading.RLock = field(default_factory=threading.RLock)
    _local: threading.local = field(default_factory=threading.local)
    _next_id: int = 0

    def __post_init__(self) -> None:
        self.default = self.new_stream("default")

    def new_stream(self, name: str = "") -> "Stream":
        with self._mu:
            self._next_id += 1
            return Stream(self, self._next_id, name or f"stream{self._next_id}")

    def current(self) -> "Stream":
        return getattr(self._local, "stream", None) or self.default

    def op(self, kind: str, resource: Hashable, stream: "Stream | None" = None) -> Op:
        """Log a device op on `stream` (default: the calling thread's current stream)."""
        s = stream or self.current()
        with self._mu:
            _merge(s.clock, self.done)
            s.seq += 1
            s.clock[s.id] = s.seq
            o = Op(
                len(self.log),
                s.id,
                s.name,
                s.seq,
                tuple(sorted(s.clock.items())),
                kind,
                resource,
                threading.current_thread().name,
            )
            self.log.append(o)
            return o

    def host_wait(self, clock: Clock, what: str) -> None:
        with self._mu:
            _merge(self.done, clock)
            self.host_syncs.append((threading.current_thread().name, what))
        record("sync", f"synchronize ({what})")

    # --- the torch.cuda surface ------------------------------------------------------------------------
    def current_stream(self, device: Any = None) -> "Stream":
        return self.current()

    def default_stream(self, device: Any = None) -> "Stream":
        return self.default

    @contextlib.contextmanager
    def stream(self, s: "Stream | None") -> Iterator[None]:
        prev = getattr(self._local, "stream", None)
        if s is not None:
            self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = prev

    def set_device(self, device: Any) -> None:
        self._local.device = device
        with self._mu:
            self.devices.append((threading.current_thread().name, device))

    def current_device(self) -> Any:
        return getattr(self._local, "device", 0)

    def synchronize(self, device: Any = None) -> None:
        with self._mu:
            every: Clock = {}
            for o in self.log:
                _merge(every, dict(o.clock))
        self.host_wait(every, "device")

    # --- checks -------------------------------------------------------------------------------------------
    def ops(self, kind: str | None = None, resource: Any = None) -> list[Op]:
        return [
            o for o in self.log if (kind is None or o.kind == kind) and (resource is None or o.resource == resource)
        ]

    def races(self, resource_pred: Any) -> list[tuple[Op, Op]]:
        """Pairs (write, other access) of a resource matching `resource_pred` on different streams that no wait or
        host sync orders either way: what a GPU may run concurrently."""
        acc = [o for o in self.log if resource_pred(o.resource)]
        out = []
        for i, a in enumerate(acc):
            for b in acc[i + 1 :]:
                if a.resource != b.resource or "write" not in (a.kind, b.kind) or a.stream == b.stream:
                    continue
                if not (b.after(a) or a.after(b)):
                    out.append((a, b))
        return out


class Stream:
    """A recording stream: its clock, and the waits a CUDA stream offers."""

    def __init__(self, owner: StandIn, sid: int, name: str):
        self.owner, self.id, self.name = owner, sid, name
        self.seq = 0
        self.clock: Clock = {sid: 0}

    def wait_stream(self, other: "Stream") -> None:
        with self.owner._mu:
            _merge(self.clock, other.clock)

    def wait_event(self, ev: "Event") -> None:
        with self.owner._mu:
            _merge(self.clock, ev.clock)

    def record_event(self, ev: "Event | None" = None) -> "Event":
        ev = ev or Event(self.owner)
        ev.record(self)
        return ev

    def synchronize(self) -> None:
        self.owner.host_wait(dict(self.clock), f"stream {self.name}")

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<stand-in stream {self.name}>"


class Event:
    """A recording event: the clock of the stream it was last recorded on."""

    def __init__(self, owner: StandIn):
        self.owner = owner
        self.clock: Clock = {}
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        s = stream or self.owner.current()
        with self.owner._mu:
            self.clock = dict(s.clock)
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        (stream or self.owner.current()).wait_event(self)

    def synchronize(self) -> None:
        self.owner.host_wait(dict(self.clock), "event")

    def query(self) -> bool:
        return True


def install(monkeypatch: Any) -> StandIn:
    """Replace torch.cuda's streams, events and devices with a fresh recording `StandIn`, and make the offload
    core order work on streams for CPU tensors. monkeypatch: anything with pytest's `setattr(obj, name, value)`
    (pytest's fixture, or `standin_blocking.Patches`), which undoes it."""
    from flashmemory.offload import streams

    si = StandIn()

    def recorded(name: str) -> Any:
        fn = getattr(si, name)

        def call(*a: Any, **k: Any) -> Any:
            with si._mu:
                si.calls.append((threading.current_thread().name, name))
            return fn(*a, **k)

        return call

    class StandInStream(Stream):
        """`torch.cuda.Stream` while installed (a class, so annotations and isinstance checks keep working)."""

        def __init__(self, device: Any = None, priority: int = 0, **_: Any):
            with si._mu:
                si.calls.append((threading.current_thread().name, "Stream"))
                si._next_id += 1
                super().__init__(si, si._next_id, f"stream{si._next_id}")

    class StandInEvent(Event):
        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **_: Any):
            with si._mu:
                si.calls.append((threading.current_thread().name, "Event"))
            super().__init__(si)

    monkeypatch.setattr(torch.cuda, "Stream", StandInStream)
    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    for name in ("current_stream", "default_stream", "stream", "set_device", "current_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, recorded(name))
    monkeypatch.setattr(streams, "streams_on", lambda device: True)
    # Staging for async copies is page-locked on a stream device; on CPU it is a `PinnedTensor`.
    monkeypatch.setattr(streams, "pinned_empty", lambda shape, dtype: pinned(torch.empty(shape, dtype=dtype)))
    return si
