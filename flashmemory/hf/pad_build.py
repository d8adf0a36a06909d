"""`flashmemory model pad --out DIR`: the trained tiny DeepSeek-V4 as a checkpoint sglang 0.5.23 serves.

Writes DIR with `config.json` (official keys, sglang's geometry: `flashmemory.hf.pad`), `model.safetensors` (fp32,
official names, the source's function kept: the padded model's fp32 logits equal the source's within 1e-4),
the task tokenizer with the DeepSeek special tokens parked on unused ids (`flashmemory.hf.task_tokenizer`),
`generation_config.json`, with --retriever also `retriever.safetensors` (the retriever reading the padded model's
128-wide index keys), and `flashmemory_build.json` (source and options by content, a SHA-256 per file).

The window stays the source's (32 for the shipped model): stock sglang attends 128 tokens whatever the config
says, so serve it with the CPU layer's window row (SGLANG_FLASHMEMORY_CPU_SWA_WINDOW, docs/configuration.md).
--index-topk: 512 (default) or 1024 are what stock sglang accepts; the source's own (16) keeps its function exactly
(the reference engine, e.g. to replay the padded model); sglang pads any top-k to a multiple of 64.

Atomic and locked like `model build-serving`: built in a temp directory beside DIR and renamed into place; an
existing DIR from the same source and options with intact files is kept; anything else there is refused.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from flashmemory.atomic import file_sha256, publish_dir
from flashmemory.errors import UserError

MANIFEST = "flashmemory_build.json"
KIND = "flashmemory-padded"
RETRIEVER_FILE = "retriever.safetensors"


class PadError(UserError):
    """The padded checkpoint cannot be written as asked; the message names the file or option and why."""


def _source_identity(src: Path, retriever: Path | None, index_topk: int) -> dict:
    ident = {"model": file_sha256(src / "model.safetensors"), "config": file_sha256(src / "config.json")}
    ident["index_topk"] = int(index_topk)
    ident["retriever"] = file_sha256(retriever) if retriever is not None else None
    return ident


def write_padded(tmp: Path, src: Path, index_topk: int, retriever: Path | None) -> dict:
    """Write every file of the padded checkpoint into the empty directory `tmp`; returns the manifest."""
    import torch

    from flashmemory.hf.models import load_model
    from flashmemory.hf.pad import pad_model, pad_retriever
    from flashmemory.hf.serving_build import _write_safetensors
    from flashmemory.hf.serving_model import official_state_dict
    from flashmemory.hf.task_tokenizer import write_tokenizer
    from flashmemory.tasks.tokenizer import load_tokenizer

    model, config = load_model(str(src), dtype=torch.float32)
    try:
        padded, raw = pad_model(model, config, index_topk)
    except ValueError as e:
        raise PadError(f"{src}: {e}") from None
    tok = load_tokenizer(None)
    raw["bos_token_id"], raw["eos_token_id"] = tok.ids["<bos>"], tok.ids["<eos>"]
    _write_safetensors(tmp / "model.safetensors", official_state_dict(padded))
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    files = ["config.json", "model.safetensors", *write_tokenizer(tmp, int(raw["vocab_size"]), tok)]
    gen = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"], "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    files.append("generation_config.json")
    if retriever is not None:
        from flashmemory.retriever.checkpoint import load_retriever, save_retriever

        ret = load_retriever(retriever)
        try:
            padded_ret = pad_retriever(ret, config)
        except ValueError as e:
            raise PadError(f"--retriever {retriever}: {e}") from None
        save_retriever(padded_ret, tmp / RETRIEVER_FILE, {"padded_from": file_sha256(retriever)})
        files.append(RETRIEVER_FILE)
    manifest = {"kind": KIND, "source": _source_identity(src, retriever, index_topk)}
    manifest["files"] = {f: file_sha256(tmp / f) for f in files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def intact(out: Path, ident: dict) -> bool:
    """True if `out` is a finished padded build of this source and these options whose files match their hashes."""
    try:
        man = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(man, dict) or man.get("kind") != KIND or man.get("source") != ident:
        return False
    files = man.get("files")
    return isinstance(files, dict) and all((out / f).is_file() and file_sha256(out / f) == h for f, h in files.items())


def check_source(src: Path, retriever: Path | None, index_topk: int) -> None:
    """One-line refusals of a source that cannot be padded, before anything is written."""
    for name in ("config.json", "model.safetensors"):
        if not (src / name).is_file():
            raise PadError(f"--src {src}: no {name} (a trained DeepSeek-V4 checkpoint directory)")
    if retriever is not None and not retriever.is_file():
        raise PadError(f"--retriever {retriever}: no such file")
    if index_topk < 1:
        raise PadError(f"--index-topk {index_topk}: must be >= 1")


def build_padded(
    src: str | os.PathLike, out: str | os.PathLike, index_topk: int = 512, retriever: str | os.PathLike | None = None
) -> Path:
    """Pad the checkpoint at `src` into `out` (atomic, locked, idempotent); returns the directory path."""
    src, out = Path(src), Path(out).resolve()
    ret = Path(retriever) if retriever is not None else None
    check_source(src, ret, index_topk)
    if out.parent.exists() and not out.parent.is_dir():
        raise PadError(f"--out {out}: its parent is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    ident = _source_identity(src, ret, index_topk)
    return publish_dir(
        out,
        lambda tmp: write_padded(tmp, src, index_topk, ret),
        lambda d: intact(d, ident),
        lambda: PadError(
            f"--out {out}: exists and is not an intact padded build of this source and these options; "
            "choose another --out (nothing was deleted)"
        ),
    )


def _run(args: argparse.Namespace) -> int:
    out = build_padded(args.src, args.out, args.index_topk, args.retriever)
    print(out)
    return 0


def add_pad(model_sub, default_src: str) -> None:
    """Add `pad` to the `flashmemory model` subparsers; `default_src`: the shipped trained model's directory."""
    p = model_sub.add_parser(
        "pad",
        help="pad the trained tiny DeepSeek-V4 (and its retriever) into the geometry sglang serves",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="output directory (must not exist, or be the same build)")
    p.add_argument(
        "--src", default=default_src, help="trained checkpoint directory (default: the shipped dsv4-retrieval)"
    )
    p.add_argument(
        "--index-topk",
        type=int,
        default=512,
        help="the padded config's index top-k (default 512, what stock sglang accepts; the source's keeps it exact)",
    )
    p.add_argument("--retriever", default=None, help="a retriever checkpoint of the source model to pad alongside")
    p.set_defaults(func=_run)
