"""The recording stand-in for `torch.cuda`, as the tests use it (pytest's monkeypatch undoes every patch).

The stand-in itself lives in the package, since `flashmemory bench step` counts with it too:
`flashmemory.bench.standin_streams` (streams, events, devices; happens-before by vector clocks) and
`flashmemory.bench.standin_blocking` (every operation a CUDA device would block the host on, per thread: host
reads of device values, copies from pageable host memory, synchronizes). Read their module docs.
"""

from __future__ import annotations

from typing import Any

from flashmemory.bench import standin_blocking as _blocking
from flashmemory.bench.standin_blocking import (  # noqa: F401 (re-exported)
    BLOCKING,
    FACTORIES,
    SYNC_METHODS,
    Blocking,
    DeviceTensor,
    PinnedTensor,
    on_device,
    on_thread,
    pinned,
    reset,
)
from flashmemory.bench.standin_streams import Event, Op, StandIn, Stream, install  # noqa: F401 (re-exported)


def device_factories(monkeypatch: Any) -> None:
    """For the rest of the test, tensors made with an explicit non-None `device=` are `DeviceTensor`s."""
    _blocking.device_factories(monkeypatch.setattr)


def count_blocking(monkeypatch: Any) -> StandIn:
    """For the rest of the test: the stream stand-in (`install`), device factories, `host.to(device)` and pinned
    staging counted (`standin_blocking.count_transfers`), the log emptied. Read it with `on_thread`."""
    si = install(monkeypatch)
    _blocking.count_transfers(monkeypatch.setattr)
    reset()
    return si
