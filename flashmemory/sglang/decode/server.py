"""sglang's global server args in this process (`server_args()`), read where the plugin needs them: the runtime's
sizes and refusals, the guard's "inside a server?" when it stops one. Imports sglang only when called. And what a
scheduler's own fields say about it (`scheduler_idle`)."""

from __future__ import annotations

from typing import Any


def server_args() -> Any:
    """sglang's global server args in this process, or None where they are not set (tests, tools)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, ValueError, AttributeError, RuntimeError):
        return None


def scheduler_idle(sched: Any) -> bool:
    """No request runs or has a forward whose result is still to be processed (so none holds an engine row)."""
    running, last = getattr(sched, "running_batch", None), getattr(sched, "last_batch", None)
    return (
        (running is None or running.is_empty())
        and (last is None or last.is_empty())
        and not getattr(sched, "result_queue", None)
    )
