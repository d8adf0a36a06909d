"""Entry point `flashmemory.sglang.plugin:register` (group `sglang.srt.plugins`).

sglang's `load_plugins()` calls `register()` in the launcher, in every scheduler process and in a few
helpers. With every gate off nothing is registered and sglang runs as shipped. Otherwise the hooks of
the active features are registered, applied at once, and each target is checked to be really patched:
sglang only logs a hook that fails to apply, and `load_plugins` swallows exceptions, so a failure here
raises `PluginStartupError`, a SystemExit, which does stop the process with the message.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from flashmemory.env import EnvError, FlashMemoryEnv
from flashmemory.sglang.targets import HookSpec, TargetError, check_signature, features_for, resolve, specs_for, unwrap

if TYPE_CHECKING:
    from flashmemory.retriever.model import JointRetriever

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it
_STATE: dict | None = None   # set once per process: {"features": ..., "targets": [...]}


class PluginStartupError(SystemExit):
    """FlashMemory cannot start with the requested gates; the message says which and why."""

    def __init__(self, msg: str):
        super().__init__(f"FlashMemory startup error: {msg}")


def verify_patched(specs: list[HookSpec], originals: dict[str, object]) -> list[str]:
    """Targets whose current attribute is still the original (or does not wrap it): the hook did not apply."""
    bad = []
    for s in specs:
        try:
            _, _, now = resolve(s.target)
        except TargetError as e:
            bad.append(str(e))
            continue
        orig = originals[s.target]
        if now is orig or unwrap(now) is not unwrap(orig):
            bad.append(f"{s.target} is not patched (see the 'Failed to apply hooks' log line above)")
    return bad


def check_retriever(env: FlashMemoryEnv) -> "JointRetriever":
    """Load SGLANG_RETRIEVER_INLINE_CKPT completely, now, before sglang loads the model: every layer of
    SGLANG_RETRIEVER_INLINE_LAYERS, shapes, finite values, and the hidden size against the served model's
    config.json when its path is known. A bad checkpoint is a PluginStartupError (one line)."""
    from flashmemory.retriever.checkpoint import CheckpointError
    from flashmemory.sglang.retriever_load import load_serving_retriever, served_model_path
    from flashmemory.sglang.runtime import server_args
    try:
        return load_serving_retriever(env, served_model_path(server_args(), sys.argv))
    except CheckpointError as e:
        raise PluginStartupError(str(e)) from None


def register() -> None:
    """Idempotent: read the gates, register and apply the hooks of the active features, verify them."""
    global _STATE
    if _STATE is not None:
        return
    try:
        env = FlashMemoryEnv.from_environ()
    except EnvError as e:
        raise PluginStartupError(str(e)) from None
    cpu_targets: list[str] = []
    if env.cpu:  # independent of the FlashMemory gates: CPU + all gates off = stock sglang on CPU
        from flashmemory.sglang.cpu import pd as cpu_pd
        from flashmemory.sglang.cpu.install import install
        cpu_targets = install()
        cpu_pd.install()   # PD on CPU: NIXL over host DRAM, and the `fake` backend's fixes
    features = features_for(env)
    retriever = None
    if not features:
        _STATE = {"features": (), "targets": [], "cpu_targets": cpu_targets}
        logger.info("FlashMemory: all gates off; no hooks registered (stock sglang)")
        return
    if "path_p" in features:
        try:
            from flashmemory.sglang import adapter_factory  # noqa: F401  (built when the pool exists)
        except ImportError as e:
            raise PluginStartupError(f"SGLANG_DECODE_SWAP_P=1 needs flashmemory.sglang.adapter_factory ({e})") from None
        if env.retriever_ckpt:
            retriever = check_retriever(env)
    specs = specs_for(features)
    originals: dict[str, object] = {}
    try:
        for s in specs:
            check_signature(s)
            originals.setdefault(s.target, resolve(s.target)[2])
    except TargetError as e:
        raise PluginStartupError(f"{e}; active features {list(features)} need it") from None

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from flashmemory.sglang import hooks
    from flashmemory.sglang.runtime import RUNTIME

    RUNTIME.configure(env, features, retriever)
    for s in specs:
        HookRegistry.register(s.target, getattr(hooks, s.hook), HookType(s.hook_type))
    HookRegistry.apply_hooks()
    bad = verify_patched(specs, originals)
    if bad:
        raise PluginStartupError("hooks did not apply: " + "; ".join(bad))
    _STATE = {"features": features, "targets": sorted({s.target for s in specs}), "cpu_targets": cpu_targets}
    logger.info("FlashMemory: active features: %s (%d hook targets)", ", ".join(env.active_features() or features),
                len(_STATE["targets"]))


def state() -> dict | None:
    """What `register()` did in this process (None before it ran)."""
    return _STATE
