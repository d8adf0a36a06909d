"""Build or load a DeepSeek-V4 `DeepseekV4ForCausalLM` for the CPU reference engine.

Shipped configs (`flashmemory/hf/configs/<name>.json`, official `config.json` key style) build a
seeded random model without touching the hub:

- `tiny-flash`: the real 43-layer Flash schedule (2 SWA, 21 CSA "c4", 20 HCA "c128") at hidden 64.
- `micro`: 9 layers [SWA, SWA, c4, c128, c4, c128, c4, c128, c4] (4 c4 layers), same widths, for tests.

Both use 16 index heads: with fewer heads, exact ReLU-zero ties in the indexer scores let top-k
break ties differently in prefill and decode, and the two paths stop agreeing.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

_CONFIG_PACKAGE = "flashmemory.hf"


def shipped_configs() -> list[str]:
    """Names of the configs shipped in `flashmemory/hf/configs/` (e.g. ['micro', 'tiny-flash'])."""
    root = resources.files(_CONFIG_PACKAGE).joinpath("configs")
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def _read_json(path: Path | str, text: str | None = None) -> dict:
    try:
        raw = json.loads(text if text is not None else Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def config_dict(name: str) -> dict:
    """The raw JSON dict of a shipped config (a copy the caller may edit)."""
    if name not in shipped_configs():
        raise ValueError(f"unknown model config {name!r}; shipped configs: {shipped_configs()}")
    res = resources.files(_CONFIG_PACKAGE).joinpath("configs", f"{name}.json")
    return _read_json(f"flashmemory/hf/configs/{name}.json", res.read_text())


def make_config(raw: dict, source: str = "<dict>") -> DeepseekV4Config:
    """A `DeepseekV4Config` from an official-style dict; rejects non-V4 model types with `source` named."""
    mt = raw.get("model_type", "deepseek_v4")
    if mt != "deepseek_v4":
        raise ValueError(f"{source}: model_type {mt!r} is not 'deepseek_v4'")
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        return DeepseekV4Config(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: invalid DeepSeek-V4 config ({e})") from e


def build_random(config: DeepseekV4Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> DeepseekV4ForCausalLM:
    """A randomly initialised model, bitwise identical for the same (config, seed).

    transformers' own init is used (normal(0, initializer_range) weights, zero sinks, zero
    compressor position bias), except the hash-MoE table `tid2eid`, which transformers zeroes
    (every token would route to expert 0 twice): here each token gets distinct seeded experts.
    The global torch RNG is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(config)
        g = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                perm = torch.rand(config.vocab_size, config.n_routed_experts, generator=g).argsort(dim=-1)
                gate.tid2eid.copy_(perm[:, : gate.top_k])
    return model.to(dtype).eval()


def load_model(
    name_or_path: str, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[DeepseekV4ForCausalLM, DeepseekV4Config]:
    """Return (model in eval mode, config).

    `name_or_path` is one of `shipped_configs()` (seeded random model), a local `.json` config file
    (seeded random model from it), or a local checkpoint directory with `config.json` (loaded with
    `from_pretrained(local_files_only=True)`; `seed` is ignored). Nothing is downloaded.
    """
    if name_or_path in shipped_configs():
        config = make_config(config_dict(name_or_path), f"flashmemory/hf/configs/{name_or_path}.json")
        return build_random(config, seed, dtype), config
    p = Path(name_or_path)
    if p.is_file() and p.suffix == ".json":
        config = make_config(_read_json(p), str(p))
        return build_random(config, seed, dtype), config
    if p.is_dir():
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{p}: checkpoint directory has no config.json")
        raw = _read_json(cfg_file)
        if raw.get("model_type") != "deepseek_v4":
            raise ValueError(f"{cfg_file}: model_type {raw.get('model_type')!r} is not 'deepseek_v4'")
        model = DeepseekV4ForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=dtype)
        return model.eval(), model.config
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a shipped config {shipped_configs()} nor an existing checkpoint "
        "directory or .json config file"
    )
