"""Is a directory a DeepSeek-V4 serving checkpoint sglang 0.5.23 can load? Checked before any server starts.

sglang's DeepSeek-V4 code fixes much of the geometry (paths inside the installed `sglang/srt/`):
- the architecture it registers: `DeepseekV4ForCausalLM` (`models/deepseek_v4.py`, `EntryClass`);
- head 512 = 448 nope + 64 rope (the c4 KV entry of 584 B, `mem_cache/deepseek_v4_memory_pool.py`; the
  backend asserts head 512), one KV head (`models/deepseek_v4.py`), index head 128 (`dsv4/indexer.py`);
- a compress ratio per layer in {0, 1, 2, 4, 128} (`models/deepseek_v4.py`), index top-k 512 or 1024
  (`deepseek_v4_backend.py`);
- a sliding window of 128 tokens, a module constant of the backend (`SWA_WINDOW`, `deepseek_v4_backend.py:161`)
  that the config's `window_size` does not change: a checkpoint with another window (the padded trained model,
  `flashmemory model pad`: 32) is served only with the CPU layer's window row set to it
  (SGLANG_FLASHMEMORY_CPU_SWA_WINDOW, `flashmemory.sglang.cpu.patches_tiny`), and the row only with such a model;
- weights: `model.safetensors` (or a sharded index) whose embedding is [vocab_size, hidden_size];
- a fast tokenizer (`tokenizer.json`) holding, as added tokens, the DeepSeek special tokens the chat encoder
  needs to encode its start-up conversation (`entrypoints/openai/serving_deepseek_recipe.py`): without them the
  server refuses to start.

A directory that fails is a `UserError`, one line naming the file and the field; the trained HF model
(`flashmemory/hf/trained/dsv4-retrieval`: head 128, rope 32, index head 64, top-k 16) is refused on its head.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from flashmemory.errors import UserError

ARCHITECTURE = "DeepseekV4ForCausalLM"
FIXED_DIMS: tuple[tuple[str, int], ...] = (
    ("head_dim", 512),
    ("qk_rope_head_dim", 64),
    ("qk_nope_head_dim", 448),
    ("num_key_value_heads", 1),
    ("index_head_dim", 128),
)
COMPRESS_RATIOS = (0, 1, 2, 4, 128)
INDEX_TOPKS = (512, 1024)
SGLANG_SWA_WINDOW = 128
WINDOW_VAR = "SGLANG_FLASHMEMORY_CPU_SWA_WINDOW"
# What sglang's DeepSeek-V4 chat encoder looks up to encode its start-up conversation (measured: removing any
# one of these from the serving-tiny tokenizer stops the start; the other special tokens are optional there).
BOOT_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>")
EMBED_NAMES = ("embed.weight", "model.embed_tokens.weight")
_MAX_HEADER = 1 << 28  # a safetensors header larger than 256 MB is not one


def _json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise UserError(f"{what}: {path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{what}: {path} is not readable JSON ({e})") from None


def _int(cfg: dict, key: str, path: Path) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"{path}: {key}={v!r}: expected a positive integer")
    return v


def _check_config(cfg: Any, path: Path) -> dict:
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: expected a JSON object")
    arch = cfg.get("architectures")
    if not isinstance(arch, list) or ARCHITECTURE not in arch:
        raise UserError(f"{path}: architectures={arch!r}: sglang 0.5.23 serves DeepSeek-V4 as [{ARCHITECTURE!r}]")
    layers = _int(cfg, "num_hidden_layers", path)
    for key, want in FIXED_DIMS:
        have = cfg.get(key)
        if have is None and key == "qk_nope_head_dim":  # sglang derives it: head_dim - qk_rope_head_dim
            continue
        if have != want:
            raise UserError(
                f"{path}: {key}={have!r}: sglang 0.5.23's DeepSeek-V4 code needs {want} "
                "(head 512 = 448 nope + 64 rope, one KV head, index head 128); not a serving checkpoint"
            )
    ratios = cfg.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < layers:
        raise UserError(
            f"{path}: compress_ratios={ratios!r}: sglang needs one compress ratio per layer "
            f"({layers} layers, from {COMPRESS_RATIOS})"
        )
    bad = [r for r in ratios if isinstance(r, bool) or r not in COMPRESS_RATIOS]
    if bad:
        raise UserError(f"{path}: compress_ratios: {bad[:4]} not among sglang's ratios {COMPRESS_RATIOS}")
    if cfg.get("index_topk") not in INDEX_TOPKS or isinstance(cfg.get("index_topk"), bool):
        raise UserError(f"{path}: index_topk={cfg.get('index_topk')!r}: sglang 0.5.23 accepts only 512 or 1024")
    _int(cfg, "vocab_size", path)
    _int(cfg, "hidden_size", path)
    return cfg


def _check_window(cfg: dict, path: Path, swa_window: int) -> None:
    """The checkpoint's sliding window against the one sglang will attend (its 128, or the window row's)."""
    key = "window_size" if "window_size" in cfg else "sliding_window"
    window = cfg.get(key, SGLANG_SWA_WINDOW)
    served = swa_window or SGLANG_SWA_WINDOW
    if window == served:
        return
    if not swa_window:
        raise UserError(
            f"{path}: {key}={window!r}: sglang 0.5.23 attends {SGLANG_SWA_WINDOW} tokens whatever the config says "
            f"(deepseek_v4_backend.py:161); serve it with the CPU layer's window row: {WINDOW_VAR}={window}"
        )
    raise UserError(f"{path}: {key}={window!r}, but {WINDOW_VAR}={swa_window} sets the served window to {served}")


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor name -> {dtype, shape, data_offsets}); UserError naming the
    file when it is not one. Reads the header only."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
            if not 2 <= n <= _MAX_HEADER:
                raise ValueError(f"header length {n}")
            head = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e}); truncated?") from None
    if not isinstance(head, dict):
        raise UserError(f"{path}: not a readable safetensors file (header is not an object)")
    return head


def _weight_files(model: Path) -> list[Path]:
    single = model / "model.safetensors"
    if single.is_file():
        return [single]
    index = model / "model.safetensors.index.json"
    if not index.is_file():
        raise UserError(f"--model {model}: no weights (model.safetensors or model.safetensors.index.json)")
    raw = _json(index, "--model")
    wmap = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise UserError(f"{index}: weight_map is missing or empty")
    files = [model / f for f in sorted(set(map(str, wmap.values())))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{index}: weight_map names {len(missing)} missing shard(s), e.g. {missing[0]}")
    return files


def _check_weights(model: Path, cfg: dict) -> None:
    want = [cfg["vocab_size"], cfg["hidden_size"]]
    for f in _weight_files(model):
        head = safetensors_header(f)
        for name in EMBED_NAMES:
            if name in head:
                shape = head[name].get("shape") if isinstance(head[name], dict) else None
                if shape != want:
                    raise UserError(
                        f"{f}: {name} has shape {shape}, but config.json says [vocab_size, hidden_size] = {want}"
                    )
                return
    raise UserError(f"--model {model}: no embedding ({' or '.join(EMBED_NAMES)}) in its weights")


def _check_tokenizer(model: Path) -> None:
    path = model / "tokenizer.json"
    tok = _json(path, "--model")
    added = tok.get("added_tokens") if isinstance(tok, dict) else None
    have = {a.get("content") for a in added if isinstance(a, dict)} if isinstance(added, list) else set()
    missing = [t for t in BOOT_TOKENS if t not in have]
    if missing:
        raise UserError(
            f"{path}: added_tokens lacks the DeepSeek special token(s) {', '.join(missing)}: sglang's DeepSeek-V4 "
            "chat encoder needs them and the server would refuse to start"
        )


def check_serving_model(model: Path, swa_window: int = 0) -> Path:
    """`model` if it is a DeepSeek-V4 serving checkpoint sglang 0.5.23 can load (see the module doc), else a
    UserError naming the file and field. swa_window: the window the servers' window row sets (0: none, sglang's
    128). Reads config.json, the weights' headers and tokenizer.json only."""
    if not model.is_dir():
        raise UserError(f"--model {model}: not a directory")
    cfg = _check_config(_json(model / "config.json", "--model"), model / "config.json")
    _check_window(cfg, model / "config.json", swa_window)
    _check_weights(model, cfg)
    _check_tokenizer(model)
    return model
