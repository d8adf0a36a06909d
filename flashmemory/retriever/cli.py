"""`flashmemory checkpoint inspect|convert|download`: get, check and convert retriever weights.

Checkpoints are read with `torch.load(weights_only=True)` (tensors only; no pickled code runs) or
safetensors. Converted files are written atomically. Weights never go into git (see checkpoints/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from flashmemory.errors import fail
from flashmemory.retriever.checkpoint import (
    CheckpointError,
    checkpoint_keys,
    inspect_checkpoint,
    load_retriever,
    save_retriever,
    unused_keys,
)

DEFAULT_REPO = "libertywing/FlashMemory-Deepseek-V4"
DEFAULT_FILE = "top3_R930_joint.pt"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="inspect, convert or download retriever checkpoints",
        description="Retriever checkpoints: upstream joint .pt files and our .safetensors.",
    )
    csub = p.add_subparsers(dest="checkpoint_cmd", metavar="ACTION")

    ip = csub.add_parser("inspect", help="print layers, dims, dtypes and parameter count")
    ip.add_argument("path", help=".pt/.pth or .safetensors file")
    ip.add_argument(
        "--layer", type=int, default=None, help="c4-layer id to report for a single-layer (unprefixed) checkpoint"
    )
    ip.add_argument("--json", action="store_true", help="print the summary as JSON")
    ip.set_defaults(func=_inspect)

    cp = csub.add_parser("convert", help="convert a .pt checkpoint to .safetensors (weights only, fp32)")
    cp.add_argument("src", help="input .pt/.pth (or .safetensors) file")
    cp.add_argument("dst", help="output .safetensors file")
    cp.add_argument("--layer", type=int, default=None, help="c4-layer id for a single-layer (unprefixed) checkpoint")
    cp.add_argument("--layers", default=None, help="only these c4-layer ids, e.g. 10,12,20 (default: all)")
    cp.add_argument(
        "--rope-dim",
        type=int,
        default=None,
        help="RoPE dims of each head (default 64, or head_dim // 2 for head_dim < 128)",
    )
    cp.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    cp.set_defaults(func=_convert)

    dp = csub.add_parser("download", help="download the released weights from the Hugging Face Hub")
    dp.add_argument("--repo", default=DEFAULT_REPO, help=f"Hub repo id (default {DEFAULT_REPO})")
    dp.add_argument("--file", default=DEFAULT_FILE, help=f"file in the repo (default {DEFAULT_FILE})")
    dp.add_argument("--dest", default="checkpoints", help="folder to put it in (default checkpoints/)")
    dp.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    dp.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the Hub to answer, > 0 (default 10)"
    )
    dp.set_defaults(func=_download)

    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _fail(what: str, msg: str | BaseException) -> int:
    """`flashmemory checkpoint WHAT: error: ...`, exit 1 (this command's historical code), named by the subcommand
    like every other command's error; --debug re-raises an exception instead."""
    return fail(f"checkpoint {what}", msg, code=1)


def _human(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _inspect(args: argparse.Namespace) -> int:
    try:
        info = inspect_checkpoint(args.path, single_layer_id=args.layer)
    except (CheckpointError, OSError) as e:
        return _fail("inspect", e)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
        return 0
    print(f"checkpoint  {info['path']}")
    print(f"layers      {', '.join(map(str, info['layers'])) or '(none)'}  (c4-layer ids)")
    for lid in info["layers"]:
        d = info["dims"][lid]
        print(
            f"  l{lid:<3}     hidden {d['hidden']}  rank {d['rank']}  heads {d['n_heads']} x {d['head_dim']}"
            f"  rope {d['rope_dim']}"
        )
    print(f"dtypes      {', '.join(info['dtypes'])}")
    print(f"parameters  {info['n_params']:,} ({_human(info['n_params'])})")
    if info["ignored_keys"]:
        print(
            f"ignored     {len(info['ignored_keys'])} RoPE buffer(s) (recomputed at load): "
            f"{', '.join(info['ignored_keys'])}"
        )
    if info["unknown_keys"]:
        print(f"unknown     {_keys_line(info['unknown_keys'])}")
    if info["metadata"]:
        print(f"metadata    {', '.join(sorted(info['metadata']))}")
    return 0


def _keys_line(keys: list[str], shown: int = 8) -> str:
    """'N key(s) the retriever does not use (not loaded, not converted): a, b, ... (+M more)'."""
    more = f" (+{len(keys) - shown} more)" if len(keys) > shown else ""
    return f"{len(keys)} key(s) the retriever does not use (not loaded, not converted): {', '.join(keys[:shown])}{more}"


def _convert(args: argparse.Namespace) -> int:
    from flashmemory.retriever.rope import RopeConfig

    dst = Path(args.dst)
    if dst.suffix != ".safetensors":
        return _fail("convert", f"{dst}: output must end in .safetensors")
    if dst.is_dir():
        return _fail("convert", f"{dst}: is a directory (--force replaces a file, never a directory)")
    if dst.exists() and not args.force:
        return _fail("convert", f"{dst} exists (pass --force to overwrite)")
    if Path(args.src).resolve() == dst.resolve():
        return _fail("convert", f"{dst}: input and output are the same file")
    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()] if args.layers else None
    except ValueError:
        return _fail("convert", f"--layers {args.layers!r}: expected comma-separated c4-layer ids like 10,12,20")
    try:
        rope = RopeConfig(rope_dim=args.rope_dim) if args.rope_dim is not None else None
        model = load_retriever(args.src, layers=layers, single_layer_id=args.layer, rope=rope)
        out = save_retriever(model, dst, extra_meta={"source": Path(args.src).name})
    except (CheckpointError, ValueError, OSError) as e:
        return _fail("convert", e)
    try:
        unknown = unused_keys(checkpoint_keys(args.src))
    except CheckpointError:
        unknown = []
    if unknown:
        print(f"note: {args.src}: {_keys_line(unknown)}", file=sys.stderr)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: layers {','.join(map(str, model.layers))}, {n:,} parameters, rope_dim {model.rope.rope_dim}")
    return 0


def _download(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.timeout) and args.timeout > 0):  # 0 would make the reachability probe non-blocking
        return _fail("download", f"--timeout {args.timeout}: must be a number of seconds > 0 (default 10)")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return _fail("download", "huggingface_hub is not installed (pip install huggingface_hub)")
    dest = Path(args.dest)
    if not _offline():
        err = _reachable(args.timeout)
        if err:  # fail in `timeout` seconds instead of the hub's ~25 s of retries with backoff
            return _fail(
                "download",
                f"could not download {args.repo}/{args.file}: {err} (no network? set HF_ENDPOINT for "
                "a mirror, or HF_HUB_OFFLINE=1 to use the local cache)",
            )
    print(f"downloading {args.repo}/{args.file} -> {dest}/ ...", file=sys.stderr)
    try:
        path = hf_hub_download(
            repo_id=args.repo, filename=args.file, revision=args.revision, local_dir=dest, etag_timeout=args.timeout
        )
    except KeyboardInterrupt:
        raise
    except Exception as e:  # the hub raises many types (offline, HTTP, missing entry, network, disk)
        hint = (
            "offline mode is on (HF_HUB_OFFLINE=1) and the file is not in the local cache"
            if _offline()
            else "no network, a wrong --repo/--file, or a gated repo needing HF_TOKEN?"
        )
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return _fail("download", f"could not download {args.repo}/{args.file}: {type(e).__name__}: {first} ({hint})")
    print(path)
    print(f"check it with: flashmemory checkpoint inspect {path}", file=sys.stderr)
    return 0


def _reachable(timeout: float) -> str:
    """'' if the Hub endpoint accepts a TCP connection within `timeout` s (or a proxy is configured), else why not."""
    import socket
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    url = urllib.parse.urlsplit(constants.ENDPOINT)
    if urllib.request.getproxies().get(url.scheme):
        return ""  # the proxy decides; let the hub try
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"cannot reach {host}:{port} ({type(e).__name__}: {e})"
    return ""


def _offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:
        return False
