"""What one training run trains and how it is built: `TrainConfig` (frozen; every knob of `Trainer`), the joint
retriever built from it (`build_model`, with `resolve_layers` choosing the c4 layers and `init_from_native` the
native init), and the per-batch forward + loss (`LogitsHead` wraps the retriever so one forward, the unit DDP
synchronises, yields {layer: logits [B, n]}; `batch_loss` runs it under bf16 autocast when asked).
`flashmemory.train.loop` drives these; nothing here touches the output dir.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.retriever.rope import RopeConfig
from flashmemory.train.losses import retrieval_loss
from flashmemory.train.samples import SampleConfig


@dataclass(frozen=True)
class TrainConfig:
    data_config: str
    output_dir: str = "./checkpoints"
    resume_from: str | None = None
    weight_dir: str | None = "./weights"
    no_pretrain: bool = False
    max_position: int = 0  # training-time RoPE clamp; 0 = DeepSeek-V4's 1,048,576 (serving clamps
    # at SGLANG_RETRIEVER_MAX_POSITION whatever the file stores)
    joint_layers: tuple[int, ...] = ()  # () = 10,12,20 if dumped, else every dumped target layer
    n_heads: int = 64
    q_lora_rank: int = 1024
    rope_dim: int = 0  # 0 = 64 for head_dim >= 128, else head_dim // 2
    lr: float = 1e-4
    wd: float = 1e-2
    epochs: int = 3
    batch_size: int = 8
    bf16: bool = False
    focal_loss: bool = False
    pairwise: float = 0.0  # weight of the BPR term (0 = off)
    sample: SampleConfig = field(default_factory=SampleConfig)
    val_stride: int = 4
    threshold: float = 0.5
    select_ensemble: str = "max"
    patience_vals: int = 0
    val_every_steps: int = 0
    seed: int = 42
    device: str = "cpu"
    num_workers: int = 0
    log_interval: int = 50
    allow_pickle: bool = False
    overwrite: bool = False  # move an earlier run's files in output_dir aside instead of refusing
    progress: bool = True  # the per-epoch progress bar (log lines are printed either way)


class LogitsHead(nn.Module):
    """Wraps the retriever so one forward (the unit DDP synchronises) yields {L: logits [B, n]}."""

    def __init__(self, retriever: JointRetriever):
        super().__init__()
        self.retriever = retriever

    def forward(
        self, hidden: dict[int, torch.Tensor], positions: torch.Tensor, keys: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        return {L: self.retriever.layer(L).logits(hidden[L], positions, keys[L]) for L in self.retriever.layers}


def to_device(batch: dict, device: torch.device) -> dict:
    out = {}
    for k, v in batch.items():
        out[k] = {L: x.to(device) for L, x in v.items()} if isinstance(v, dict) else v.to(device)
    return out


def batch_loss(head: nn.Module, batch: dict, cfg: TrainConfig, device: torch.device) -> torch.Tensor:
    """Forward + loss for one collated batch (already on `device`), under bf16 autocast if asked."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        logits = head(batch["hidden"], batch["positions"], batch["keys"])
        return retrieval_loss(logits, batch, focal=cfg.focal_loss, pairwise=cfg.pairwise)


def default_rope_dim(head_dim: int) -> int:
    return 64 if head_dim >= 128 else max(2, head_dim // 2)


def resolve_layers(
    requested: tuple[int, ...], first_doc: Path, allow_pickle: bool = False
) -> tuple[tuple[int, ...], str]:
    """The c4 layers to train: as requested, or (when none) upstream's 10,12,20 if the dump has them,
    else every target layer of the dump (tiny models have fewer c4 layers). Returns (layers, note)."""
    if requested:
        return tuple(requested), ""
    from flashmemory.dump.format import load_doc

    have = tuple(load_doc(first_doc, allow_pickle=allow_pickle).target_layers)
    if all(L in have for L in (10, 12, 20)):
        return (10, 12, 20), ""
    return have, f"dump has target layers {list(have)} (not 10,12,20): training all of them"


def build_model(
    cfg: TrainConfig, layers: tuple[int, ...], hidden: int, head_dim: int, max_position: int
) -> JointRetriever:
    dims = RetrieverDims(
        hidden=hidden,
        rank=cfg.q_lora_rank,
        n_heads=cfg.n_heads,
        head_dim=head_dim,
        rope_dim=cfg.rope_dim or default_rope_dim(head_dim),
    )
    rope = RopeConfig(rope_dim=dims.rope_dim, max_position=max_position)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return JointRetriever(layers, dims, rope)


def init_from_native(model: JointRetriever, weight_dir: str) -> dict[int, str]:
    """Native init from a checkpoint dir, or from a shipped HF model name (e.g. 'micro')."""
    from flashmemory.train.native_init import NativeWeights, copy_native

    if not Path(weight_dir).is_dir():
        from flashmemory.hf.models import load_model, shipped_configs

        if weight_dir not in shipped_configs():
            raise FileNotFoundError(
                f"--weight-dir {weight_dir}: not a directory nor a shipped model "
                f"{shipped_configs()} (use --no-pretrain for a random init)"
            )
        hf, config = load_model(weight_dir)
        native = NativeWeights(hf.state_dict())
        native.cfg = {"layer_types": list(config.layer_types)}
    else:
        native = NativeWeights(weight_dir)
    return copy_native(model, native)
