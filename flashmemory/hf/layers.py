"""Layer bookkeeping: which model layers are c4 (CSA) layers, and c4-layer ids.

A "c4 layer id" is the index of a CSA layer in `c4_layer_ids(config)`; retriever layers 10/12/20
and everything keyed by c4 id refer to it. In DeepSeek-V4-Flash the c4 layers are the even model
layers 2..42, so c4 id i is model layer 2 + 2i.
"""

from __future__ import annotations

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
SWA = "sliding_attention"


def c4_layer_ids(config) -> list[int]:
    """Model layer index of every CSA layer, ascending; position in the list is the c4 layer id."""
    types = getattr(config, "layer_types", None)
    if not types:
        raise ValueError("config has no layer_types; is it a DeepseekV4Config?")
    return [i for i, t in enumerate(types) if t == CSA]


def c4_ratio(config) -> int:
    """Compression ratio of the CSA layers (4 in every released V4 model)."""
    return int(config.compress_rates[CSA])


def layer_counts(config) -> dict[str, int]:
    """{'swa': n, 'c4': n, 'c128': n} over the model's layers (HCA counted as c128 whatever its rate)."""
    types = list(config.layer_types)
    return {"swa": types.count(SWA), "c4": types.count(CSA), "c128": types.count(HCA)}


def check_c4_ids(ids, n_c4_layers: int, what: str = "capture_layers") -> list[int]:
    """Validate c4-layer ids; returns them sorted and unique."""
    out = sorted({int(i) for i in ids})
    bad = [i for i in out if not 0 <= i < n_c4_layers]
    if bad:
        raise ValueError(f"{what}: c4 layer ids {bad} out of range [0, {n_c4_layers})")
    return out
