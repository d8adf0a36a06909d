"""`flashmemory train`: train the joint retriever on golden-label dumps (flags follow upstream train.py)."""

from __future__ import annotations

import argparse
import json

import torch

from flashmemory.env import EnvError, parse_layers


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and weights")
    g.add_argument(
        "--data-config",
        required=True,
        metavar="FILE",
        help='JSON/YAML file naming train/val/test dump dirs: {"train": [{"data_dir": DIR, '
        '"doc_ids": [..]|null}], "val": [...], "test": [...]}; relative dirs resolve '
        "against the config file's directory",
    )
    g.add_argument(
        "--output-dir", default="./checkpoints", help="where checkpoints and metrics.jsonl go (default %(default)s)"
    )
    g.add_argument(
        "--resume-from",
        default=None,
        metavar="CKPT",
        help="epoch checkpoint (ckpt_joint_epochEEE.pt) to continue from: weights, optimizer, schedule, "
        "step. Into the same --output-dir it continues that run as it stood at CKPT (what was written "
        "after it, e.g. by a killed run, is moved aside)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="if --output-dir already holds a run, move its checkpoints and metrics.jsonl aside into "
        "OUTPUT_DIR/previous-<time>/ and start fresh (without it, such a dir is refused)",
    )
    g.add_argument(
        "--weight-dir",
        default="./weights",
        help="native DeepSeek-V4 weights for the init: a dir of safetensors shards (official or HF names, "
        "fp8 dequantized) with config.json, or a shipped model name such as 'micro' "
        "(default %(default)s)",
    )
    g.add_argument("--no-pretrain", action="store_true", help="random init instead of native indexer weights")
    g.add_argument(
        "--max-position",
        type=int,
        default=0,
        help="RoPE position clamp in training; 0 = DeepSeek-V4's 1,048,576 (default %(default)s). Serving "
        "clamps at SGLANG_RETRIEVER_MAX_POSITION whatever the checkpoint stores",
    )
    g.add_argument("--allow-pickle", action="store_true", help="also read upstream .pkl dump docs (runs pickled code)")
    m = p.add_argument_group("model")
    m.add_argument(
        "--joint-layers",
        default=None,
        help="c4-layer ids to train jointly (default 10,12,20, or every dumped target layer when the "
        "dump lacks them, as on tiny models)",
    )
    m.add_argument("--n-heads", type=int, default=64, help="retriever heads (default %(default)s)")
    m.add_argument("--q-lora-rank", type=int, default=None, help="q-LoRA rank (default 1024)")
    m.add_argument("--rope-dim", type=int, default=0, help="RoPE dims per head; 0 = 64, or head_dim/2 below 128")
    s = p.add_argument_group("samples")
    s.add_argument(
        "--label-interval", type=int, default=64, help="tau: lookahead window [t, t+tau) (default %(default)s)"
    )
    s.add_argument("--max-pos", type=int, default=512, help="positives per sample (default %(default)s)")
    s.add_argument("--neg-ratio", type=float, default=1.0, help="negatives per positive (default %(default)s)")
    s.add_argument("--sample-interval", type=int, default=1, help="use every k-th decode step (default %(default)s)")
    s.add_argument("--weighted-loss", action="store_true", help="upstream vote weights: 3 votes -> 0.5 ... 21 -> 2.0")
    s.add_argument("--vote-range", default="3,21", help="votes mapped to weights 0.5 and 2.0 (default %(default)s)")
    s.add_argument(
        "--no-causal",
        action="store_true",
        help="upstream sampling: negatives and positives may be chunks that do not exist yet at t "
        "(for comparison only; see training/README.md)",
    )
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default %(default)s)")
    o.add_argument("--wd", type=float, default=1e-2, help="AdamW weight decay (default %(default)s)")
    o.add_argument(
        "--epochs", type=int, default=3, help="epochs; cosine schedule over all of them (default %(default)s)"
    )
    o.add_argument("--batch-size", type=int, default=8, help="samples per step per process (default %(default)s)")
    o.add_argument("--bf16", action="store_true", help="bf16 autocast for forward and loss")
    o.add_argument("--focal-loss", action="store_true", help="focal loss (gamma 2, no alpha) instead of BCE")
    o.add_argument("--pairwise", type=float, default=0.0, metavar="W", help="add W x pairwise BPR loss (default off)")
    v = p.add_argument_group("validation")
    v.add_argument(
        "--val-stride", type=int, default=4, help="score all chunks every k-th decode step (default %(default)s)"
    )
    v.add_argument("--threshold", type=float, default=0.5, help="sigmoid threshold for P/R/F1 (default %(default)s)")
    v.add_argument(
        "--select-ensemble",
        choices=("max", "mean"),
        default="max",
        help="ensemble used to pick best checkpoints (max = serving's 'or') (default %(default)s)",
    )
    v.add_argument("--val-every-steps", type=int, default=0, help="also validate every N steps (0 = per epoch only)")
    v.add_argument(
        "--patience-vals",
        type=int,
        default=0,
        help="stop after N validations without a better ensemble F1 or r@512 (0 = never)",
    )
    x = p.add_argument_group("misc")
    x.add_argument("--seed", type=int, default=42, help="(default %(default)s)")
    x.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (default: cuda if available, else cpu)",
    )
    x.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (default %(default)s)")
    x.add_argument("--log-interval", type=int, default=50, help="log a line every N steps (default %(default)s)")
    x.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")


def config_from_args(a: argparse.Namespace):
    from flashmemory.train.loop import TrainConfig
    from flashmemory.train.samples import SampleConfig

    layers = parse_layers(a.joint_layers, "--joint-layers", n_c4_layers=1 << 20) if a.joint_layers else ()
    try:
        lo, hi = (int(x) for x in a.vote_range.split(","))
    except ValueError:
        raise EnvError(f"--vote-range {a.vote_range!r}: expected LO,HI like 3,21") from None
    sample = SampleConfig(
        label_interval=a.label_interval,
        max_pos=a.max_pos,
        neg_ratio=a.neg_ratio,
        sample_interval=a.sample_interval,
        weighted=a.weighted_loss,
        causal=not a.no_causal,
        vote_lo=lo,
        vote_hi=hi,
    )
    return TrainConfig(
        data_config=a.data_config,
        output_dir=a.output_dir,
        resume_from=a.resume_from,
        weight_dir=a.weight_dir,
        no_pretrain=a.no_pretrain,
        max_position=a.max_position,
        joint_layers=layers,
        n_heads=a.n_heads,
        q_lora_rank=a.q_lora_rank or 1024,
        rope_dim=a.rope_dim,
        lr=a.lr,
        wd=a.wd,
        epochs=a.epochs,
        batch_size=a.batch_size,
        bf16=a.bf16,
        focal_loss=a.focal_loss,
        pairwise=a.pairwise,
        sample=sample,
        val_stride=a.val_stride,
        threshold=a.threshold,
        select_ensemble=a.select_ensemble,
        patience_vals=a.patience_vals,
        val_every_steps=a.val_every_steps,
        seed=a.seed,
        device=a.device,
        num_workers=a.num_workers,
        log_interval=a.log_interval,
        allow_pickle=a.allow_pickle,
        overwrite=a.overwrite,
        progress=not a.no_progress,
    )


def check_ranges(cfg) -> None:
    """Range-check the numeric flags where they are read (UserError naming the flag)."""
    import math

    from flashmemory.errors import UserError

    at_least = {
        "epochs": 1,
        "batch_size": 1,
        "log_interval": 1,
        "val_stride": 1,
        "n_heads": 1,
        "q_lora_rank": 1,
        "rope_dim": 0,
        "max_position": 0,
        "num_workers": 0,
        "val_every_steps": 0,
        "patience_vals": 0,
    }
    for name, lo in at_least.items():
        if getattr(cfg, name) < lo:
            raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= {lo}")
    if not 0 <= cfg.seed < 2**63:  # torch seeds are 64-bit; a larger one was "Overflow when unpacking long long"
        raise UserError(f"--seed {cfg.seed}: must lie in [0, 2**63)")
    if cfg.rope_dim % 2:
        raise UserError(f"--rope-dim {cfg.rope_dim}: must be even")
    for name, lo, hi in (("lr", 0.0, 10.0), ("wd", 0.0, 10.0), ("threshold", 0.0, 1.0), ("pairwise", 0.0, 1e3)):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and lo <= v <= hi) or (name == "lr" and v == 0):
            raise UserError(f"--{name} {v}: must lie in {'(' if name == 'lr' else '['}{lo}, {hi}]")
    check_device(cfg.device)


def check_device(name: str) -> None:
    """--device names a torch device this process can use (UserError naming the flag, before any data is read)."""
    from flashmemory.errors import UserError

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name}: not a torch device (cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"--device {name}: torch sees no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: there are {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    elif dev.type != "cpu":
        try:
            torch.empty(1, device=dev)
        except Exception as e:  # torch raises several types for a backend that is absent
            raise UserError(f"--device {name}: not usable here ({type(e).__name__}: {e})") from None


def run(a: argparse.Namespace) -> int:
    """Expected failures (bad data, flags, output dir, a diverged run, file-system errors) are one line, exit 2."""
    from flashmemory.errors import UserError, fail
    from flashmemory.train.ddp import shutdown
    from flashmemory.train.loop import Trainer

    try:
        cfg = config_from_args(a)
        check_ranges(cfg)
        trainer = Trainer(cfg)
    except (UserError, ValueError, OSError) as e:  # UserError covers dump, data-config, checkpoint, env errors
        return fail("train", e)
    try:
        if trainer.moved_aside is not None:
            print(f"moved the earlier run's files in {cfg.output_dir} aside into {trainer.moved_aside}")
        for note in trainer.resume_notes:
            print(f"note: {note}")
        if trainer.info.is_main:
            if trainer.layer_note:
                print(f"note: {trainer.layer_note}")
            for lid, note in trainer.init_notes.items():
                print(f"init l{lid}: {note}")
            print(
                f"train: {len(trainer.train_ds)} samples, {trainer.steps_per_epoch} steps/epoch x {cfg.epochs} "
                f"epochs, world {trainer.info.world}, device {trainer.device}; val k_eff {trainer.validator.k_eff}"
            )
        try:
            summary = trainer.fit()
        except (UserError, OSError) as e:  # a diverged run, a full disk, an unwritable file
            return fail("train", e)
        if trainer.info.is_main:
            print(json.dumps({k: v for k, v in summary.items() if k != "losses"}))
    finally:
        shutdown(trainer.info)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train the joint Memory-Indexer retriever on golden-label dumps",
        description="Train the joint retriever (one sample per decode step with a golden label in its "
        "lookahead window; only chunks that exist at that step are used). Runs under "
        "torchrun for DDP (gloo on CPU, NCCL on GPU).",
    )
    add_train_args(p)
    p.set_defaults(func=run)
