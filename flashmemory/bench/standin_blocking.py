"""What a CUDA device would make the host wait for, counted on CPU tensors (the blocking half of the stand-in).

On a GPU, sglang's overlap scheduler enqueues forward t+1 while forward t runs; any host operation that waits for
the device in a hook drains that pipeline. On CPU nothing waits, so the waits are counted instead. A tensor
"on the device" is a `DeviceTensor` (a CPU tensor standing for one on the accelerator: `on_device`, or made by a
factory with `device=` once `device_factories` is on); a plain tensor is pageable host memory; a `PinnedTensor`
is page-locked host memory (made by `flashmemory.offload.streams.pinned_empty` while `count_transfers` is on).

Counted, per thread, in `BLOCKING` as `Blocking(thread, kind, function, where)`:
  d2h   a host read of device values: `.cpu()`, `.item()`, `.tolist()`, `.numpy()`, `bool()` / `int()` /
        `float()` / `__index__` of a device tensor, a boolean-mask index of one (the host reads the output size),
        `host.copy_(device)` and a host tensor mixed into a device op, unless the destination is pinned and the
        copy is `non_blocking=True`;
  h2d   a copy from pageable host memory to the device: `device.copy_(host)`, `device[idx] = host`,
        `index_copy_` / `index_put_` / any device op taking a host tensor (an index included; 0-dim host tensors
        are scalars, not copies), `torch.tensor(..., device=)`. `host.to(device)` is counted where a device op
        takes its result (on CPU the stand-in device and the host are one device, so `.to(device)` cannot tell a
        device target from a host one; a host tensor moved to the host never meets a device op); a pinned source
        moved with `non_blocking=True` is a device tensor at once and not counted;
  sync  `torch.cuda.synchronize()`, `Stream.synchronize()`, `Event.synchronize()` (recorded by the stream
        stand-in, `standin_streams`).
`.to("cpu")` of a device tensor is not counted (on CPU the stand-in device and the host are one device; the
serving path spells host reads `.cpu()`). `DeviceTensor.syncs` keeps the d2h host reads alone, as before.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
FACTORIES = ("full", "zeros", "empty", "ones", "arange", "tensor")
_MU = threading.Lock()


class Blocking(NamedTuple):
    """One blocking operation: the thread it ran on, d2h / h2d / sync, the flashmemory function and its line."""

    thread: str
    kind: str
    function: str
    where: str


BLOCKING: list[Blocking] = []  # every blocking operation, in host order (reset with `reset`)


def reset() -> None:
    with _MU:
        BLOCKING.clear()
        DeviceTensor.syncs = []


def _frame() -> traceback.FrameSummary | None:
    stack = traceback.extract_stack()[:-2]
    return next((f for f in reversed(stack) if "/flashmemory/" in f.filename and "/standin_" not in f.filename), None)


def record(kind: str, what: str) -> Blocking:
    """Log a blocking operation of `kind` on the calling thread, located at its innermost flashmemory frame."""
    f = _frame()
    where = f"{f.filename.rsplit('/flashmemory/', 1)[-1]}:{f.lineno} {what}: {f.line}" if f else what
    b = Blocking(threading.current_thread().name, kind, f.name if f else "?", where)
    with _MU:
        BLOCKING.append(b)
        if kind == "d2h" and (what in SYNC_METHODS or what.endswith("(boolean mask)")):
            DeviceTensor.syncs.append((b.thread, b.function, b.where))
    return b


def on_thread(name: str | None = None, kinds: tuple[str, ...] = ("d2h", "h2d", "sync")) -> list[Blocking]:
    """The blocking operations logged on thread `name` (default: the calling thread)."""
    name = name or threading.current_thread().name
    return [b for b in BLOCKING if b.thread == name and b.kind in kinds]


def _flat(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat(y)
    else:
        yield x


def is_device(t: Any) -> bool:
    return isinstance(t, DeviceTensor)


def is_host(t: Any) -> bool:
    """A host tensor that moving to / from the device copies (0-dim tensors ride along as scalars)."""
    return isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) and t.dim() > 0


def is_pinned(t: Any) -> bool:
    return isinstance(t, PinnedTensor)


def _non_blocking(args: tuple, kwargs: dict, pos: int) -> bool:
    return bool(kwargs.get("non_blocking", args[pos] if len(args) > pos else False))


def _classify(name: str, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(kind, what) when torch function `name` over args would block a CUDA host, else None."""
    a0 = args[0] if args else None
    if name in SYNC_METHODS:
        return ("d2h", name) if is_device(a0) else None
    if name in ("__getitem__", "__setitem__") and is_device(a0) and len(args) > 1:
        idx = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
            return "d2h", f"{name} (boolean mask)"
    if name == "copy_" and len(args) > 1:
        dst, src = a0, args[1]
        if is_device(dst) and is_host(src):
            return None if is_pinned(src) and _non_blocking(args, kwargs, 2) else ("h2d", "copy_ from host")
        if is_host(dst) and is_device(src):
            return None if is_pinned(dst) and _non_blocking(args, kwargs, 2) else ("d2h", "copy_ to host")
        return None
    flat = list(_flat((args, kwargs)))
    if not any(is_device(t) for t in flat):
        return None
    host = [t for t in flat if is_host(t)]
    if not host:
        return None
    if is_device(a0) or name in ("__setitem__", "index_copy_", "index_put_", "index_fill_"):
        return "h2d", f"{name} with a host tensor"
    return "d2h", f"{name} of a host tensor with a device tensor"


def _result(ret: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The result's stand-in class: device if any input is on the device (host reads excepted), pinned if it is
    a view of a pinned input, else plain."""
    if not isinstance(ret, torch.Tensor):
        if isinstance(ret, (list, tuple)) and not isinstance(ret, torch.Size):
            return type(ret)(_result(r, args, kwargs, name) for r in ret) if type(ret) in (list, tuple) else ret
        return ret
    if name in SYNC_METHODS:  # a host read: a plain host tensor (on CPU `.cpu()` returns its input itself)
        return ret.as_subclass(torch.Tensor)
    flat = list(_flat((args, kwargs)))
    for t in flat:
        if ret is t:
            return ret  # in place: keeps what it was
    plain = ret.as_subclass(torch.Tensor) if type(ret) is not torch.Tensor else ret
    if any(is_device(t) for t in flat):
        return plain.as_subclass(DeviceTensor)
    ptr = plain.untyped_storage().data_ptr()
    if any(is_pinned(t) and t.untyped_storage().data_ptr() == ptr for t in flat):
        return plain.as_subclass(PinnedTensor)
    return plain


class _Counted(torch.Tensor):
    """Shared `__torch_function__` of the stand-in's tensor classes: count, run on plain tensors, re-class."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        hit = _classify(name, tuple(args), kwargs)
        if hit is not None:
            record(*hit)
        with torch._C.DisableTorchFunctionSubclass():
            ret = func(*args, **kwargs)
        return _result(ret, tuple(args), kwargs, name)


class DeviceTensor(_Counted):
    """A CPU tensor standing for one on the accelerator (see the module doc). `syncs`: the d2h host reads,
    (thread name, flashmemory function, "file:line what: code"), kept for the tests that read them."""

    syncs: list[tuple[str, str, str]] = []


class PinnedTensor(_Counted):
    """Page-locked host memory: the source of an H2D (or destination of a D2H) copy that need not block."""


def on_device(t: torch.Tensor) -> torch.Tensor:
    """`t` as a `DeviceTensor` (same storage)."""
    return t.as_subclass(DeviceTensor)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` as a `PinnedTensor` (same storage)."""
    return t.as_subclass(PinnedTensor)


Setattr = Callable[[Any, str, Any], None]


def device_factories(setattr_: Setattr) -> None:
    """Tensors made with an explicit non-None `device=` are `DeviceTensor`s; `torch.tensor(..., device=)` is an
    h2d copy from pageable memory. setattr_: monkeypatch.setattr or a `Patches`."""
    for name in FACTORIES:
        orig = getattr(torch, name)

        def make(*a: Any, _o: Any = orig, _n: str = name, **k: Any) -> Any:
            out = _o(*a, **k)
            if k.get("device") is None:
                return out
            if _n == "tensor":
                record("h2d", "torch.tensor(..., device=)")
            return on_device(out)

        setattr_(torch, name, make)


def _device_arg(args: tuple, kwargs: dict) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (str, int, torch.device)) and not isinstance(a, bool):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def count_transfers(setattr_: Setattr) -> None:
    """`pinned.to(device, non_blocking=True)` is a `DeviceTensor` (an async copy, not counted);
    `flashmemory.offload.streams.pinned_empty` makes `PinnedTensor`s; `is_pinned` answers for them. Also turns on
    `device_factories`; `streams.is_device` tells `DeviceTensor`s apart."""
    from flashmemory.offload import streams

    base_to = torch._C.TensorBase.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not (is_pinned(self) and kwargs.get("non_blocking", False) and _device_arg(args, kwargs) is not None):
            return base_to(self, *args, **kwargs)  # a pageable result is counted where a device op takes it
        with torch._C.DisableTorchFunctionSubclass():
            out = base_to(self, *args, **kwargs)
        return on_device(out.as_subclass(torch.Tensor))

    setattr_(torch.Tensor, "to", to)
    setattr_(torch.Tensor, "is_pinned", lambda self, *a, **k: is_pinned(self))
    setattr_(streams, "is_device", is_device)
    setattr_(streams, "pinned_empty", lambda shape, dtype: pinned(torch.empty(shape, dtype=dtype)))  # as install's
    device_factories(setattr_)


@dataclass
class Patches:
    """A setattr that remembers what it replaced; `undo` puts it back (monkeypatch for code outside pytest)."""

    done: list[tuple[Any, str, Any]] = field(default_factory=list)

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        self(obj, name, value)

    def __call__(self, obj: Any, name: str, value: Any) -> None:
        old = obj.__dict__.get(name, _UNSET) if isinstance(obj, type) else getattr(obj, name)
        self.done.append((obj, name, old))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self.done:
            obj, name, old = self.done.pop()
            if old is _UNSET:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_UNSET = object()
