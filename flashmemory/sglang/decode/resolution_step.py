"""The launcher's start-up refusal: FlashMemory's `step` row around sglang's last server-argument resolution step.

It runs in the launcher process, before any scheduler, data-parallel controller or tokenizer starts, so it runs
outside the hooks' guard on purpose: the guard serves scheduler processes (it aborts requests or stops the server),
and here a refusal must reach the launcher as the `StartupError` (a SystemExit) it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashmemory.sglang.decode.refusals import refusals, refuse
from flashmemory.sglang.decode.runtime import RUNTIME


def refuse_at_resolution(server_args: Any, previous: Callable[[Any], None]) -> None:
    """sglang's last server-argument resolution step, wrapped (`register_resolution_hook`): run it, then refuse
    what the active features cannot serve (`refusals` with this process's gates, `RUNTIME.env` and
    `RUNTIME.features`, which `plugin.register` set before applying this row). Raises StartupError: the launcher
    stops with the one line before it starts any other process."""
    previous(server_args)
    refuse(refusals(server_args, RUNTIME.env, RUNTIME.features))
