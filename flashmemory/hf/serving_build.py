"""`flashmemory model build-serving --out DIR`: write the serving-tiny checkpoint (see `serving_model`).

The build is seeded and deterministic (same seed -> byte-identical files), written into a temp directory
beside DIR and renamed into place at the end, under a lock file `DIR.lock`. An existing DIR built with the
same seed and intact files is kept as is; anything else at DIR is refused (never deleted).

`init_std` (default: the config's `initializer_range`, 0.1) rescales the random weights. The default build's
bytes, manifest included, do not depend on this option; a build with another `init_std` records it in the
manifest, and `intact` only keeps a build whose seed and `init_std` both match. The equivalence test uses
0.02 (transformers' default init), where fp8-KV noise stays small against the logit spread (see
`flashmemory/sglang/cpu/README.md`, Equivalence).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from flashmemory.atomic import file_sha256, publish_dir
from flashmemory.hf.serving_model import SPECIAL_TOKENS, official_state_dict, serving_config

MANIFEST = "flashmemory_build.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


class BuildError(RuntimeError):
    """The output directory cannot be written as asked; the message names it and why."""


def build_tokenizer(vocab_size: int):
    """Byte-level BPE without merges: ids 0..25 the DeepSeek specials, then the 256 byte symbols, then filler
    symbols up to `vocab_size` so every id the model can emit decodes. Any text encodes (byte by byte)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_syms = list(pre_tokenizers.ByteLevel.alphabet())
    byte_syms.sort()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for s in byte_syms:
        vocab[s] = len(vocab)
    i = 0
    while len(vocab) < vocab_size:
        vocab[f"ĠÂ{i}"] = len(vocab)  # spells " Â<i>" when decoded: visibly a filler id
        i += 1
    if len(vocab) != vocab_size:
        raise BuildError(f"tokenizer needs {len(vocab)} ids but vocab_size is {vocab_size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: tensors[k] for k in sorted(tensors)}, str(path), metadata={"format": "pt"})


def _check_init_std(init_std: float | None) -> None:
    if init_std is not None and not (isinstance(init_std, (int, float)) and 0 < init_std < float("inf")):
        raise BuildError(f"init_std must be a finite number > 0, got {init_std!r}")


def write_checkpoint(tmp: Path, seed: int, init_std: float | None = None) -> dict:
    """Write every file of the checkpoint into the empty directory `tmp`; returns the manifest dict.
    `init_std` None keeps the config's `initializer_range` (and leaves it out of the manifest)."""
    from flashmemory.hf.models import build_random, make_config

    _check_init_std(init_std)
    raw = serving_config()
    if init_std is not None:
        raw["initializer_range"] = float(init_std)
    config = make_config(raw, "serving-tiny")
    model = build_random(config, seed=seed, dtype=torch.bfloat16)
    tensors = official_state_dict(model)
    _write_safetensors(tmp / "model.safetensors", tensors)
    (tmp / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    tok = build_tokenizer(int(raw["vocab_size"]))
    tok.save(str(tmp / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": int(raw["max_position_embeddings"]),
        "clean_up_tokenization_spaces": False,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    gen = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"], "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    manifest = {"kind": "flashmemory-serving-tiny", "seed": seed}
    if init_std is not None:
        manifest["init_std"] = float(init_std)
    manifest["files"] = {f: file_sha256(tmp / f) for f in FILES}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def intact(out: Path, seed: int, init_std: float | None = None) -> bool:
    """True if `out` is a finished build with this seed and init_std (None: the default, recorded as absent)
    whose files still match their recorded hashes."""
    try:
        man = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if man.get("kind") != "flashmemory-serving-tiny" or man.get("seed") != seed:
        return False
    if man.get("init_std") != (None if init_std is None else float(init_std)):
        return False
    return all((out / f).is_file() and file_sha256(out / f) == h for f, h in man.get("files", {}).items())


def build_serving(out: str | os.PathLike, seed: int = 0, init_std: float | None = None) -> Path:
    """Build the checkpoint at `out` (atomic, locked, idempotent); returns the directory path.
    `init_std` None: the default weights (the config's initializer_range)."""
    _check_init_std(init_std)
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    what = f"seed {seed}" + ("" if init_std is None else f" and init_std {float(init_std)}")
    return publish_dir(
        out,
        lambda tmp: write_checkpoint(tmp, seed, init_std),
        lambda d: intact(d, seed, init_std),
        lambda: BuildError(
            f"{out}: exists and is not an intact serving-tiny build with {what}; "
            "choose another --out (nothing was deleted)"
        ),
    )


def _run(args: argparse.Namespace) -> int:
    try:
        out = build_serving(args.out, args.seed, args.init_std)
    except BuildError as e:
        from flashmemory.errors import fail

        return fail("model build-serving", e)
    print(out)
    return 0


def add_build_serving(model_sub) -> None:
    """Add `build-serving` to the `flashmemory model` subparsers."""
    p = model_sub.add_parser(
        "build-serving",
        help="write the tiny DeepSeek-V4 checkpoint sglang serves on CPU",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="output directory (must not exist, or be the same build)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument(
        "--init-std",
        type=float,
        default=None,
        help="std of the random weights (default: the config's initializer_range, 0.1)",
    )
    p.set_defaults(func=_run)
