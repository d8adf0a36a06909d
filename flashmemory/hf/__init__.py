"""CPU reference engine on transformers' DeepSeek-V4: seeded tiny models, indexer capture, Level-2 mask.

The names below load on first use (PEP 562): importing a light submodule such as `flashmemory.hf.serving_build`
(every `flashmemory` command registers its parser) does not import transformers, which took 5 of the CLI's 8 s
to start here.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ForwardCapture": "engine",
    "HFEngine": "engine",
    "stored_index_keys": "engine",
    "unstored_index_keys": "engine",
    "c4_layer_ids": "layers",
    "load_model": "models",
    "shipped_configs": "models",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
