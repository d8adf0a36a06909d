"""CPU reference engine on transformers' DeepSeek-V4: seeded tiny models, indexer capture, Level-2 mask."""

from flashmemory.hf.engine import ForwardCapture, HFEngine, stored_index_keys, unstored_index_keys
from flashmemory.hf.layers import c4_layer_ids
from flashmemory.hf.models import load_model, shipped_configs

__all__ = ["ForwardCapture", "HFEngine", "c4_layer_ids", "load_model", "shipped_configs", "stored_index_keys",
           "unstored_index_keys"]
