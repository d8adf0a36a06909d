"""Files this process owns on disk (page stores), removed when it is told to stop.

A page store is removed by `PageStore.close()`. A server stopped by SIGTERM or SIGINT would otherwise leave its
store behind until the next store opens in the same directory (`remove_stale_stores`). `own(path)` records a path
this process created; the first call installs, in the main thread only, a handler for SIGTERM and SIGINT that
unlinks every owned path and then hands the signal on to the handler that was there before (Python's default
SIGINT handler raises KeyboardInterrupt; SIG_DFL is restored and the signal re-sent, so the process still dies of
it; a signal that was ignored stays ignored and removes nothing, as the process goes on). An `atexit` hook does
the same at a normal exit.

Only unlinking is done in the handler: descriptors stay open, so I/O in flight on other threads ends on the
unlinked file instead of failing; the space returns when the process exits. Paths never recorded here (anything
the project did not create) are never touched. SIGKILL cannot be caught: the store's lock dies with the process,
and the next store in that directory removes the file (`store.remove_stale_stores`).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("flashmemory.offload.disk")

_lock = threading.Lock()
_paths: set[str] = set()
_installed = False
_signals = False
_previous: dict[int, Any] = {}
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def own(path: str) -> None:
    """Record `path` (a file this process just created) for removal at SIGTERM / SIGINT / exit."""
    with _lock:
        _paths.add(path)
    _install()


def disown(path: str) -> None:
    """Forget `path` (its owner removed it, or handed it on)."""
    with _lock:
        _paths.discard(path)


def owned() -> set[str]:
    """A copy of the paths recorded now."""
    with _lock:
        return set(_paths)


def remove_owned() -> list[str]:
    """Unlink every recorded path that still exists; returns the paths removed. Safe to call more than once."""
    with _lock:
        paths = sorted(_paths)
        _paths.clear()
    gone = []
    for p in paths:
        try:
            os.unlink(p)
            gone.append(p)
        except FileNotFoundError:
            pass
        except OSError as e:  # reported, never raised: this runs on the way out
            log.warning("disk tier: could not remove %s at shutdown: %s", p, e.strerror or e)
    return gone


def _on_signal(signum: int, frame: FrameType | None) -> None:
    prev = _previous.get(signum, signal.SIG_DFL)
    if prev == signal.SIG_IGN:  # the process goes on running: its stores stay in use
        return
    remove_owned()
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install() -> None:
    """atexit once; the signal handlers once, from the main thread (Python allows `signal.signal` only there)."""
    global _installed, _signals
    with _lock:
        first, _installed = not _installed, True
        want_signals = not _signals and threading.current_thread() is threading.main_thread()
        _signals = _signals or want_signals
    if first:
        atexit.register(remove_owned)
    if not want_signals:
        return
    for sig in SIGNALS:
        prev = signal.getsignal(sig)
        if prev is _on_signal:
            continue
        _previous[sig] = prev if prev is not None else signal.SIG_DFL
        signal.signal(sig, _on_signal)
