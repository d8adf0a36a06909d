"""sglang's global server args in this process (`server_args()`), read where the plugin needs them: the runtime's
sizes and refusals, the guard's "inside a server?" when it stops one. Imports sglang only when called."""

from __future__ import annotations

from typing import Any


def server_args() -> Any:
    """sglang's global server args in this process, or None where they are not set (tests, tools)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, ValueError, AttributeError, RuntimeError):
        return None
