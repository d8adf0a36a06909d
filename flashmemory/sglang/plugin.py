"""Entry point `flashmemory.sglang.plugin:register` (group `sglang.srt.plugins`).

sglang's `load_plugins()` calls `register()` in the launcher, in every scheduler process and in a few
helpers. With every gate off nothing is registered and sglang runs as shipped. Otherwise the code patches of
the active features (`patching.active_features`: the CPU layer's with SGLANG_FLASHMEMORY_CPU=1, then the hook
features) go through the one apply-and-verify loop, `patching.apply`: sglang only logs a hook that fails to
apply, and `load_plugins` swallows exceptions, so a failure here raises `PluginStartupError`, a SystemExit,
which does stop the process with the message.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from flashmemory.env import EnvError, FlashMemoryEnv, cpu_tiny_geometry
from flashmemory.sglang.plumbing.patch_spec import CODE_KINDS, TargetError
from flashmemory.sglang.plumbing.patching import StartupError, apply, check_all, cpu_features, select
from flashmemory.sglang.plumbing.targets import features_for

if TYPE_CHECKING:
    from flashmemory.retriever.model import JointRetriever

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it
PluginStartupError = StartupError  # "FlashMemory startup error: ..." (a SystemExit)


def check_retriever(env: FlashMemoryEnv) -> "JointRetriever":
    """Load SGLANG_RETRIEVER_INLINE_CKPT completely, now, before sglang loads the model: every layer of
    SGLANG_RETRIEVER_INLINE_LAYERS, shapes, finite values, and the hidden size against the served model's
    config.json when its path is known. A bad checkpoint is a PluginStartupError (one line)."""
    from flashmemory.retriever.checkpoint import CheckpointError
    from flashmemory.sglang.decode.retriever_load import load_serving_retriever, served_model_path
    from flashmemory.sglang.decode.runtime import server_args

    try:
        return load_serving_retriever(env, served_model_path(server_args(), sys.argv))
    except CheckpointError as e:
        raise PluginStartupError(str(e)) from None


def announce(line: str) -> None:
    """Log `line` at INFO, or print it to stderr (the server's log) when no handler would emit it: sglang's
    launcher runs `load_plugins()` before it configures logging (the root logger is still at WARNING then), and
    its forked children do not register again, so a plain INFO record of what `register()` did would reach no
    one in a served process."""
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def register() -> None:
    """Idempotent: read the gates, apply and verify the patches of the active features. What it did is kept in
    the process state, `RUNTIME.registration`: {"features": ..., "targets": [...], "cpu_targets": [...]}."""
    from flashmemory.sglang.decode.runtime import RUNTIME

    if RUNTIME.registration is not None:
        return
    try:
        env = FlashMemoryEnv.from_environ()
        geometry = cpu_tiny_geometry()
    except EnvError as e:
        raise PluginStartupError(str(e)) from None
    cpu_targets: list[str] = []
    if env.cpu:  # independent of the FlashMemory gates: CPU + all gates off = stock sglang on CPU
        cpu_targets = apply(
            select(cpu_features(geometry), CODE_KINDS), context="; the CPU layer (SGLANG_FLASHMEMORY_CPU=1) needs it"
        )
    features = features_for(env)
    retriever = None
    if not features:
        RUNTIME.registration = {"features": (), "targets": [], "cpu_targets": cpu_targets}
        announce("FlashMemory: all gates off; no hooks registered (stock sglang)")
        return
    if "path_p" in features:
        try:
            from flashmemory.sglang.decode import adapter_factory  # noqa: F401  (built when the pool exists)
        except ImportError as e:
            raise PluginStartupError(
                f"SGLANG_DECODE_SWAP_P=1 needs flashmemory.sglang.decode.adapter_factory ({e})"
            ) from None
        if env.retriever_ckpt:
            retriever = check_retriever(env)
    specs = select(features, CODE_KINDS)
    context = f"; active features {list(features)} need it"
    try:
        check_all(specs)  # every target before the runtime is configured
    except TargetError as e:
        raise PluginStartupError(f"{e}{context}") from None

    RUNTIME.configure(env, features, retriever)
    targets = apply(specs, context=context)
    RUNTIME.registration = {"features": features, "targets": targets, "cpu_targets": cpu_targets}
    announce(
        f"FlashMemory: active features: {', '.join(env.active_features() or features)} ({len(targets)} hook targets)"
    )


def state() -> dict | None:
    """What `register()` did in this process (None before it ran)."""
    from flashmemory.sglang.decode.runtime import RUNTIME

    return RUNTIME.registration
