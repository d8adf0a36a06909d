"""Read and write retriever checkpoints.

Reads upstream joint `.pt` files (`retrievers.l{id}.{wq_a.weight, wq_b.weight, q_norm_weight,
weights_proj.weight}`, with `torch.load(weights_only=True)`, which never runs pickled code),
unprefixed single-layer files, and our `.safetensors`. Writes safetensors with the dims, layers
and RoPE parameters in the metadata. Every failure is a `CheckpointError` naming the key or cause.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import torch

from flashmemory.atomic import atomic_path
from flashmemory.errors import UserError
from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.retriever.rope import RopeConfig

PARAMS = ("wq_a.weight", "wq_b.weight", "q_norm_weight", "weights_proj.weight")
FORMAT = "flashmemory-retriever/1"
_JOINT_KEY = re.compile(r"^retrievers\.l(\d+)\.(.+)$")


class CheckpointError(UserError):
    """A retriever checkpoint is missing, truncated, or does not match what was asked for."""


def read_state(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load the raw tensors and metadata of a `.safetensors` or `.pt`/`.pth` file, on CPU."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such file")
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(p), framework="pt") as f:
                meta = dict(f.metadata() or {})
                state = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several types for a bad header or short file
            raise CheckpointError(f"{p}: unreadable safetensors file ({type(e).__name__}: {e}); truncated?") from e
        return state, meta
    if p.suffix in (".pt", ".pth", ".bin"):
        try:
            obj = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{p}: unreadable torch file ({type(e).__name__}: {e}); truncated or not a plain tensor state dict?"
            ) from e
        if isinstance(obj, dict) and "model_state" in obj and isinstance(obj["model_state"], dict):
            obj = obj["model_state"]  # a training epoch checkpoint
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(f"{p}: expected a dict of tensors (a state_dict)")
        return dict(obj), {}
    raise CheckpointError(f"{p}: unknown checkpoint type {p.suffix!r} (use .safetensors or .pt)")


def split_layers(
    state: dict[str, torch.Tensor], single_layer_id: int | None = None
) -> dict[int, dict[str, torch.Tensor]]:
    """Group a state dict by layer: joint keys by their `l{id}` prefix; unprefixed keys as `single_layer_id`."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        m = _JOINT_KEY.match(k)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = v
        else:
            plain[k] = v
    if not out and plain:
        if single_layer_id is None:
            raise CheckpointError("single-layer checkpoint (unprefixed keys): say which c4 layer it is for")
        out[single_layer_id] = plain
    return {lid: {k: v for k, v in sd.items() if k != "freqs_cis"} for lid, sd in out.items()}


def checkpoint_keys(path: str | os.PathLike) -> list[str]:
    """The tensor names in a checkpoint, without reading its tensors where the format allows (safetensors
    header; a zip-format .pt memory-mapped), else by `read_state`."""
    p = Path(path)
    try:
        if p.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(p), framework="pt") as f:
                return list(f.keys())
        obj = torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
        if isinstance(obj, dict) and isinstance(obj.get("model_state"), dict):
            obj = obj["model_state"]
        if isinstance(obj, dict):
            return [str(k) for k in obj]
    except Exception:  # an old-format .pt cannot be mapped; read_state names any real problem
        pass
    return list(read_state(p)[0])


def unused_keys(state: dict[str, torch.Tensor] | list[str]) -> list[str]:
    """Keys a load ignores without being told to: neither a retriever parameter (`PARAMS`, joint-prefixed or,
    in a file without joint keys, unprefixed) nor a RoPE buffer (`freqs_cis`, recomputed at load)."""
    joint = any(_JOINT_KEY.match(k) for k in state)
    out = []
    for k in state:
        m = _JOINT_KEY.match(k)
        name = m.group(2) if m else (None if joint else k)
        if name not in PARAMS and name != "freqs_cis":
            out.append(k)
    return sorted(out)


def infer_dims(sd: dict[str, torch.Tensor], lid: int, rope_dim: int) -> RetrieverDims:
    missing = [k for k in PARAMS if k not in sd]
    if missing:
        raise CheckpointError(f"layer {lid}: missing key(s) {', '.join(f'retrievers.l{lid}.{k}' for k in missing)}")
    for k in PARAMS:
        want = 1 if k == "q_norm_weight" else 2
        if sd[k].dim() != want:
            raise CheckpointError(f"retrievers.l{lid}.{k}: expected a {want}-D tensor, got shape {tuple(sd[k].shape)}")
    rank, hidden = sd["wq_a.weight"].shape
    n_heads = sd["weights_proj.weight"].shape[0]
    hd = sd["wq_b.weight"].shape[0]
    if n_heads == 0 or hd % n_heads:
        raise CheckpointError(f"layer {lid}: wq_b.weight rows {hd} not divisible by n_heads {n_heads}")
    return RetrieverDims(hidden=hidden, rank=rank, n_heads=n_heads, head_dim=hd // n_heads, rope_dim=rope_dim)


def expected_shapes(d: RetrieverDims) -> dict[str, tuple[int, ...]]:
    return {
        "wq_a.weight": (d.rank, d.hidden),
        "wq_b.weight": (d.n_heads * d.head_dim, d.rank),
        "q_norm_weight": (d.rank,),
        "weights_proj.weight": (d.n_heads, d.hidden),
    }


def load_retriever(
    path: str | os.PathLike,
    layers: tuple[int, ...] | list[int] | None = None,
    single_layer_id: int | None = None,
    rope: RopeConfig | None = None,
    logit_offset: float = 0.0,
    expect_hidden: int | None = None,
    max_position: int | None = None,
) -> JointRetriever:
    """Build a `JointRetriever` from a checkpoint. Every weight is checked: keys, shapes, finite values.

    layers: c4-layer ids to load (default: all in the file); a missing one is an error.
    rope: RoPE parameters; default from the file's metadata, else upstream's (rope_dim 64, or
      head_dim // 2 when head_dim < 128 as in tiny models).
    expect_hidden: if given, the model's hidden size, checked against wq_a.
    max_position: if given, the RoPE clamp to serve with, whatever the file says (the serving path
      passes SGLANG_RETRIEVER_MAX_POSITION: a file's stored length is what training saw, not a limit).
    """
    state, meta = read_state(path)
    by_layer = split_layers(state, single_layer_id)
    if not by_layer:
        raise CheckpointError(f"{path}: holds no retriever weights")
    want = tuple(sorted(layers)) if layers else tuple(sorted(by_layer))
    absent = [i for i in want if i not in by_layer]
    if absent:
        raise CheckpointError(f"{path}: layer(s) {absent} not in checkpoint (it has {sorted(by_layer)})")
    if rope is None:
        rope = rope_from_meta(meta, by_layer[want[0]])
    if max_position is not None and max_position != rope.max_position:
        rope = replace(rope, max_position=max_position)
    dims = infer_dims(by_layer[want[0]], want[0], rope.rope_dim)
    if expect_hidden is not None and dims.hidden != expect_hidden:
        raise CheckpointError(f"{path}: retriever hidden size {dims.hidden} != model hidden size {expect_hidden}")
    shapes = expected_shapes(dims)
    for lid in want:
        sd = by_layer[lid]
        infer_dims(sd, lid, rope.rope_dim)  # raises on missing keys
        for k, shp in shapes.items():
            got = tuple(sd[k].shape)
            if got != shp:
                raise CheckpointError(f"{path}: retrievers.l{lid}.{k}: shape {got} does not match expected {shp}")
    check_finite(path, {lid: by_layer[lid] for lid in want})
    model = JointRetriever(want, dims, rope, logit_offset)
    with torch.no_grad():
        for lid in want:
            layer = model.layer(lid)
            for k in PARAMS:
                layer.get_parameter(k).copy_(by_layer[lid][k].float())
    return model


def check_fits(
    model: JointRetriever,
    path: str | os.PathLike,
    hidden: int,
    index_head_dim: int,
    layers: tuple[int, ...] | list[int],
) -> None:
    """Refuse, naming the file, a retriever that cannot serve a model of this `hidden` size, indexer head dim and
    these c4 `layers` (a retriever trained for another model), before any document is run with it."""
    d = model.dims
    if d.hidden != hidden:
        raise CheckpointError(
            f"{path}: retriever for hidden size {d.hidden}, the model's is {hidden} (a retriever "
            "trained for another model)"
        )
    if d.head_dim != index_head_dim:
        raise CheckpointError(
            f"{path}: retriever head dim {d.head_dim}, the model's indexer head dim is "
            f"{index_head_dim} (a retriever trained for another model)"
        )
    absent = sorted(set(layers) - set(model.layers))
    if absent:
        raise CheckpointError(f"{path}: no retriever for c4 layer(s) {absent} (it has {list(model.layers)})")


def check_finite(path: str | os.PathLike, by_layer: dict[int, dict[str, torch.Tensor]]) -> None:
    """Raise `CheckpointError` naming the file and the first tensor that holds NaN or inf (a diverged run)."""
    for lid in sorted(by_layer):
        for k, v in by_layer[lid].items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                raise CheckpointError(
                    f"{path}: retrievers.l{lid}.{k} holds {bad} non-finite value(s) (NaN/inf) "
                    f"of {v.numel()}; the checkpoint is unusable (a diverged training run?)"
                )


def rope_from_meta(meta: dict[str, str], sd: dict[str, torch.Tensor]) -> RopeConfig:
    if "rope" in meta:
        try:
            return RopeConfig(**json.loads(meta["rope"]))
        except (ValueError, TypeError) as e:  # bad JSON, unknown field or invalid value
            raise CheckpointError(f"metadata 'rope' = {meta['rope']!r} is not a valid RopeConfig ({e})") from e
    n_heads = sd["weights_proj.weight"].shape[0] if "weights_proj.weight" in sd else 1
    head_dim = sd["wq_b.weight"].shape[0] // max(n_heads, 1) if "wq_b.weight" in sd else 128
    return RopeConfig(rope_dim=64 if head_dim >= 128 else max(2, head_dim // 2))


def retriever_metadata(model: JointRetriever) -> dict[str, str]:
    d, r = model.dims, model.rope
    return {
        "format": FORMAT,
        "layers": ",".join(map(str, model.layers)),
        "dims": json.dumps(d.__dict__),
        "rope": json.dumps(r.__dict__),
    }


def save_retriever(model: JointRetriever, path: str | os.PathLike, extra_meta: dict[str, str] | None = None) -> Path:
    """Write the joint state (fp32) to `path` as safetensors, atomically (temp file, then rename)."""
    from safetensors.torch import save_file

    p = Path(path)
    if p.is_dir():
        raise CheckpointError(f"{p}: is a directory, not a checkpoint file")
    by_layer = {
        lid: {k: model.layer(lid).get_parameter(k).detach().float().contiguous().cpu() for k in PARAMS}
        for lid in model.layers
    }
    check_finite(p, by_layer)  # never write a NaN checkpoint that a later load would refuse
    state = {f"retrievers.l{lid}.{k}": v for lid, sd in by_layer.items() for k, v in sd.items()}
    meta = retriever_metadata(model) | (extra_meta or {})
    with atomic_path(p) as tmp:  # the temp file is removed if the write fails (disk full, target a dir)
        try:
            save_file(state, str(tmp), metadata=meta)
        except Exception as e:  # safetensors reports a failed write (ENOSPC, EFBIG, EIO) as SafetensorError
            if type(e).__name__ != "SafetensorError":
                raise
            raise _write_error(e, p) from e
    return p


def _write_error(e: Exception, path: Path) -> Exception:
    """What a failed safetensors write of `path` becomes: an `OSError` naming the path when its message ends in
    "(os error N)" (the CLI prints "...: No space left on device (disk full)"), else a `CheckpointError`."""
    m = re.search(r"\(os error (\d+)\)", str(e))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code), str(path))
    return CheckpointError(f"{path}: could not write the checkpoint ({e})")


def inspect_checkpoint(path: str | os.PathLike, single_layer_id: int | None = None) -> dict:
    """Summary of a checkpoint: layers, dims, dtypes, parameter count, metadata."""
    state, meta = read_state(path)
    by_layer = split_layers(state, single_layer_id)
    if not by_layer:
        raise CheckpointError(f"{path}: holds no retriever weights")
    rope = rope_from_meta(meta, next(iter(by_layer.values())))
    dims = {lid: infer_dims(sd, lid, rope.rope_dim) for lid, sd in by_layer.items()}
    first = min(by_layer)
    want = expected_shapes(dims[first])
    for lid, sd in sorted(by_layer.items()):  # layers are loaded together: one wrong shape breaks the load
        for k, shp in want.items():
            if tuple(sd[k].shape) != shp:
                raise CheckpointError(
                    f"{path}: retrievers.l{lid}.{k}: shape {tuple(sd[k].shape)} does not match {shp} of layer {first}"
                )
    check_finite(path, by_layer)
    return {
        "path": str(path),
        "layers": sorted(by_layer),
        "dims": {lid: d.__dict__ for lid, d in dims.items()},
        "dtypes": sorted({str(v.dtype) for v in state.values()}),
        "n_params": sum(sd[k].numel() for sd in by_layer.values() for k in PARAMS),
        "ignored_keys": sorted(k for k in state if k.endswith("freqs_cis")),
        "unknown_keys": unused_keys(state),
        "metadata": meta,
    }
