"""The serving path's retriever: loaded and checked completely at plugin registration, before the model loads.

One function loads it for both the check and the engine (`adapter_factory.build`), so what is checked is
what serves: the layers of SGLANG_RETRIEVER_INLINE_LAYERS, every weight's shape and finiteness, the
hidden size against the served model's config.json when the model path is a local directory, and the
RoPE clamp of SGLANG_RETRIEVER_MAX_POSITION (a checkpoint's stored table length is ignored: a checkpoint may
carry a shorter table, e.g. 131072, which would serve every position past it as the last one). It loads on
the CPU; `place_retriever` moves it to the server's device when the pool exists.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from flashmemory.env import FlashMemoryEnv
from flashmemory.retriever.checkpoint import CheckpointError, load_retriever
from flashmemory.retriever.model import JointRetriever

logger = logging.getLogger(__name__)


def model_hidden_size(model_path: str | os.PathLike | None) -> tuple[int | None, str]:
    """(hidden_size, config path) from `model_path/config.json`; (None, why not) when it cannot be known
    (a Hub id, no config, or no hidden_size in it). A config that exists but cannot be parsed is an error."""
    if not model_path:
        return None, "no model path"
    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        return None, f"{cfg} not found"
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg}: unreadable model config ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{cfg}: model config is not a JSON object")
    h = data.get("hidden_size", (data.get("text_config") or {}).get("hidden_size"))
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        return None, f"{cfg} has no integer hidden_size"
    return h, str(cfg)


def load_serving_retriever(env: FlashMemoryEnv, model_path: str | os.PathLike | None = None) -> JointRetriever:
    """The retriever of SGLANG_RETRIEVER_INLINE_CKPT for SGLANG_RETRIEVER_INLINE_LAYERS, in eval mode.

    Raises CheckpointError (one line naming the variable, the file and the problem) for a missing or truncated
    file, absent layers, a wrong shape, a non-finite weight, or a hidden size unlike the served model's."""
    hidden, source = model_hidden_size(model_path)
    where = f"SGLANG_RETRIEVER_INLINE_CKPT={env.retriever_ckpt}"
    try:
        model = load_retriever(
            env.retriever_ckpt,
            layers=env.retriever_layers,
            logit_offset=env.logit_offset,
            max_position=env.max_position,
        )
    except CheckpointError as e:
        hint = " (SGLANG_RETRIEVER_INLINE_LAYERS names c4-layer ids)" if "not in checkpoint" in str(e) else ""
        raise CheckpointError(f"{where}: {e}{hint}") from None
    if hidden is not None and model.dims.hidden != hidden:
        raise CheckpointError(
            f"{where}: retriever hidden size {model.dims.hidden} does not match the served model's "
            f"hidden_size {hidden} ({source}); it is a checkpoint for another model"
        )
    if hidden is None:
        logger.info(
            "FlashMemory: retriever hidden size %d not checked against the model (%s)", model.dims.hidden, source
        )
    return model.eval()


def place_retriever(retriever: JointRetriever | None, device: torch.device | str) -> JointRetriever | None:
    """The serving retriever with every parameter and buffer on the server's `device` (the device of sglang's
    pool tensors), in eval mode. `load_serving_retriever` returns it on the CPU (registration runs before the
    model and its device exist); Level 1 feeds it hidden states and index keys on the server's device, so it
    must follow them. In place (`nn.Module.to`): the object the plugin checked is the one that serves."""
    if retriever is None:
        return None
    return retriever.to(torch.device(device)).eval()


def served_model_path(server_args: Any, argv: list[str]) -> str | None:
    """The served model's path: from sglang's server args when they are published, else from the launch
    command line (`--model-path X`, `--model X` or `=X` forms). sglang loads plugins before it parses its
    arguments, and spawned schedulers inherit the launcher's argv, so registration can see it either way."""
    path = getattr(server_args, "model_path", None)
    if path:
        return str(path)
    for i, a in enumerate(argv):
        for flag in ("--model-path", "--model"):
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None
