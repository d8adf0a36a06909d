"""The training loop: AdamW + cosine schedule, validation, checkpoints, resume, DDP. The config and the model it
trains (built, initialised, forward + loss) are `flashmemory.train.setup`.

Outputs in `output_dir`:
  ckpt_joint_best_ens_f1.safetensors / ckpt_joint_best_ens_rk.safetensors  best by ensemble F1 / r@512
      (`save_retriever` format; `load_retriever` reads them)
  ckpt_joint_epoch{E:03d}.pt  {"model_state", "optimizer", "scheduler", "epoch", "step", "best", "config"}:
      tensors, numbers and strings only, so `torch.load(weights_only=True)` reads it; resume input
  metrics.jsonl  one JSON object per log interval ("kind": "train") and per validation ("kind": "val")

The output dir is locked (`flashmemory.outdir.DirLock`) from construction to the end of `fit()`. A dir that
already holds a run is refused unless `resume_from` continues it or `overwrite` moves its files aside into
`previous-<time>/` (nothing is deleted). A non-finite loss or gradient stops training with
`TrainingDivergedError`; no checkpoint holding non-finite weights is ever written.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from flashmemory.atomic import atomic_path, atomic_write_text
from flashmemory.errors import UserError
from flashmemory.outdir import DirLock, move_aside, prepare_dir
from flashmemory.retriever.checkpoint import CheckpointError, save_retriever
from flashmemory.retriever.rope import RopeConfig
from flashmemory.train.data_config import load_data_config, trained_on_meta
from flashmemory.train.dataset import SampleDataset, collate, resolve_docs
from flashmemory.train.ddp import DistInfo, barrier, broadcast_flag, init_distributed
from flashmemory.train.rundir import BEST_F1, BEST_FILES, BEST_RK, METRICS, plan_resume, read_progress, run_files
from flashmemory.train.setup import (
    LogitsHead,
    TrainConfig,
    batch_loss,
    build_model,
    init_from_native,
    resolve_layers,
    to_device,
)
from flashmemory.train.validate import Validator

__all__ = ["BEST_F1", "BEST_RK", "TrainConfig", "Trainer", "TrainingDivergedError", "run_files"]
RK_KEY = "r@512"


def _write_jsonl(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=float) + "\n")


class TrainingDivergedError(UserError):
    """The loss or the gradient became NaN/inf; training stops and writes no checkpoint of that state."""


def _atomic_torch_save(obj: dict, path: Path) -> None:
    with atomic_path(path) as tmp:  # the temp file is removed if the write fails (disk full)
        try:
            torch.save(obj, tmp)
        except RuntimeError as e:  # torch reports a failed write (ENOSPC, EIO) as a RuntimeError
            raise OSError(f"{path}: could not write the checkpoint ({e}); disk full?") from e


class Trainer:
    """Builds everything from a TrainConfig; `fit()` runs the epochs. One instance per process."""

    def __init__(self, cfg: TrainConfig, info: DistInfo | None = None):
        self.cfg = cfg
        self.info = info or init_distributed(cfg.device)
        self.device = self.info.device
        data = load_data_config(cfg.data_config)
        self.trained_on = trained_on_meta(data.train, data.val)
        train_paths = resolve_docs(data.train, "train split")
        self.layers, self.layer_note = resolve_layers(cfg.joint_layers, train_paths[0], cfg.allow_pickle)
        self.train_ds = SampleDataset(
            train_paths, self.layers, cfg.sample, seed=cfg.seed, allow_pickle=cfg.allow_pickle
        )
        if len(self.train_ds) == 0:
            raise ValueError(
                f"{cfg.data_config}: the train split yields no samples (no decode step has a golden "
                "label among its existing chunks)"
            )
        self.validator = Validator(
            resolve_docs(data.val, "val split"),
            self.layers,
            cfg.sample,
            cfg.val_stride,
            cfg.threshold,
            allow_pickle=cfg.allow_pickle,
            sizes=self.train_ds.sizes,
        )
        # Training never bakes a short table into what it ships: the clamp is DeepSeek-V4's 1M unless asked.
        max_pos = cfg.max_position or RopeConfig().max_position
        if max_pos <= self.train_ds.max_position:
            raise UserError(
                f"--max-position {max_pos}: the dump has positions up to {self.train_ds.max_position}; "
                "they would all be clamped (use 0 for the default 1,048,576)"
            )
        self.model = build_model(cfg, self.layers, self.train_ds.hidden_size, self.train_ds.head_dim, max_pos).to(
            self.device
        )
        self.init_notes = {}
        if not cfg.no_pretrain and not cfg.resume_from:
            if not cfg.weight_dir:
                raise ValueError("--weight-dir is required unless --no-pretrain is given")
            self.init_notes = init_from_native(self.model, cfg.weight_dir)
        self.head: nn.Module = LogitsHead(self.model)
        if self.info.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.head = nn.parallel.DistributedDataParallel(self.head, device_ids=ids)
        self.sampler = DistributedSampler(
            self.train_ds,
            num_replicas=self.info.world,
            rank=self.info.rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=self.info.enabled,
        )
        self.loader = DataLoader(
            self.train_ds,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            collate_fn=collate,
            num_workers=cfg.num_workers,
            drop_last=False,
        )
        self.steps_per_epoch = len(self.loader)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.wd)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.opt, T_max=max(1, self.steps_per_epoch * cfg.epochs)
        )
        self.step, self.start_epoch = 0, 0
        self.best = {"f1": -1.0, "rk": -1.0, "stale": 0}
        self.out = Path(cfg.output_dir)
        self.metrics_path = self.out / METRICS
        self.lock: DirLock | None = None
        self.moved_aside: Path | None = None
        self.resume_notes: list[str] = []
        try:
            if cfg.resume_from:
                self.load_checkpoint(cfg.resume_from)  # every rank: same file, same outcome
            refused: Exception | None = None
            if self.info.is_main:
                try:
                    self.lock = DirLock(prepare_dir(self.out, "--output-dir"), "training output directory")
                    self.moved_aside = self._claim_output_dir()
                except (UserError, OSError) as e:
                    refused = e
            # Rank 0 alone owns the output dir; the other ranks must stop with it, not wait in a collective.
            if broadcast_flag(refused is not None, self.info):
                raise refused or UserError(f"--output-dir {self.out}: refused by rank 0 (see its message)")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the output-dir lock (`fit()` does at its end)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _claim_output_dir(self) -> Path | None:
        """Refuse to mix with an earlier run in the output dir, unless resuming it or told to overwrite.

        Resuming keeps what the run held at the resumed checkpoint and moves the rest aside
        (`flashmemory.train.rundir`). --overwrite moves every run file aside."""
        old = run_files(self.out)
        if self.cfg.resume_from and not self.cfg.overwrite:
            return self._resume_into_dir()
        if not old:
            return None
        if not self.cfg.overwrite:
            shown = ", ".join(old[:4]) + (f", ... ({len(old)} files)" if len(old) > 4 else "")
            raise UserError(
                f"--output-dir {self.out}: already holds a training run ({shown}); pass --resume-from "
                f"{self.out}/ckpt_joint_epochEEE.pt to continue it, --overwrite to move its files aside "
                "into a previous-<time>/ folder there, or choose another --output-dir"
            )
        return move_aside(self.out, old)

    def _resume_into_dir(self) -> Path | None:
        plan = plan_resume(self.out, self.start_epoch - 1, self.step)
        dest = move_aside(self.out, list(plan.move)) if plan.move else None
        if plan.metrics is not None:
            atomic_write_text(self.metrics_path, "".join(ln + "\n" for ln in plan.metrics))
            self.resume_notes.append(
                f"{self.metrics_path}: kept the records up to step {self.step}; the old file "
                f"(with records after the resumed checkpoint) is in {dest}"
            )
        for key in plan.lost_best:
            if self.best[key] >= 0:
                self.resume_notes.append(
                    f"{self.out / BEST_FILES[key]}: the best checkpoint of the resumed run (score "
                    f"{self.best[key]:.4f}) is not here or was chosen after step {self.step}; the next validation "
                    "writes it, and later ones replace it when they score higher"
                )
            self.best[key] = -1.0
        return dest

    # ---- checkpoints -------------------------------------------------------------------------
    def epoch_checkpoint(self, epoch: int) -> Path:
        return self.out / f"ckpt_joint_epoch{epoch:03d}.pt"

    def save_checkpoint(self, epoch: int) -> Path:
        cfg_json = json.dumps(asdict(self.cfg), default=str)
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:  # the per-step check stops training first; this guards the file itself
            raise TrainingDivergedError(f"{self.epoch_checkpoint(epoch)}: not written: {bad[0]} holds NaN/inf")
        obj = {
            "model_state": state,
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "epoch": epoch,
            "step": self.step,
            "best": dict(self.best),
            "config": cfg_json,
            "dims": json.dumps(self.model.dims.__dict__),
            "rope": json.dumps(self.model.rope.__dict__),
        }
        p = self.epoch_checkpoint(epoch)
        _atomic_torch_save(obj, p)
        return p

    def load_checkpoint(self, path: str | Path) -> None:
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"--resume-from {path}: unreadable ({type(e).__name__}: {e})") from e
        need = ("model_state", "optimizer", "scheduler", "epoch", "step")
        missing = [k for k in need if k not in obj]
        if missing:
            raise CheckpointError(f"--resume-from {path}: not an epoch checkpoint (missing {missing})")
        try:
            self.model.load_state_dict(obj["model_state"])
        except RuntimeError as e:
            raise CheckpointError(f"--resume-from {path}: model shapes differ from this run's flags: {e}") from None
        self.opt.load_state_dict(obj["optimizer"])
        self.sched.load_state_dict(obj["scheduler"])
        # The schedule follows this run's --epochs, continuing from the saved step.
        self.sched.T_max = max(1, self.steps_per_epoch * self.cfg.epochs)
        self.step, epoch, self.best = read_progress(obj, path, self.best)
        self.start_epoch = epoch + 1
        if self.start_epoch >= self.cfg.epochs:
            raise UserError(
                f"--resume-from {path}: that run already finished epoch {self.start_epoch} of "
                f"--epochs {self.cfg.epochs} (epochs count from 1); nothing is left to train. Pass "
                f"--epochs greater than {self.start_epoch} to train further"
            )

    # ---- validation --------------------------------------------------------------------------
    def validate(self, epoch: int) -> bool:
        """Rank 0 validates, logs and saves best checkpoints; returns the (broadcast) early-stop flag."""
        stop = False
        if self.info.is_main:
            res = self.validator(self.model, self.device)
            ens = res[self.cfg.select_ensemble]
            f1, rk = ens["f1"], ens.get(RK_KEY, float("nan"))
            improved = False
            meta = {"step": str(self.step), "epoch": str(epoch), "trained_on": self.trained_on}
            if f1 > self.best["f1"]:
                self.best["f1"], improved = f1, True
                save_retriever(self.model, self.out / BEST_F1, meta | {"ens_f1": repr(f1)})
            if not math.isnan(rk) and rk > self.best["rk"]:
                self.best["rk"], improved = rk, True
                save_retriever(self.model, self.out / BEST_RK, meta | {"ens_r@512": repr(rk)})
            self.best["stale"] = 0 if improved else self.best["stale"] + 1
            _write_jsonl(self.metrics_path, {"kind": "val", "step": self.step, "epoch": epoch, **res})
            tqdm.write(
                f"[val] step {self.step} ens-{self.cfg.select_ensemble}: f1 {f1:.4f} {RK_KEY} {rk:.4f} "
                f"auc {ens['auc']:.4f} P {ens['precision']:.4f} R {ens['recall']:.4f} "
                f"resident {ens['resident_frac']:.3f}"
            )
            stop = self.cfg.patience_vals > 0 and self.best["stale"] >= self.cfg.patience_vals
        return broadcast_flag(stop, self.info)

    # ---- loop --------------------------------------------------------------------------------
    def train_one(self, batch: dict) -> float:
        self.head.train()
        batch = to_device(batch, self.device)
        loss = batch_loss(self.head, batch, self.cfg, self.device)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        # After backward, so every DDP rank sees the same all-reduced gradient and stops together.
        if not (bool(torch.isfinite(loss.detach())) and bool(torch.isfinite(gnorm))):
            raise TrainingDivergedError(
                f"training diverged at step {self.step + 1}: loss {float(loss.detach()):.4g}, gradient norm "
                f"{float(gnorm):.4g} "
                f"(non-finite); stopped before the optimizer step, so the weights and the checkpoints in "
                f"{self.out} are from before it. Check the dump for NaN/inf values or lower --lr"
            )
        self.opt.step()
        self.sched.step()
        self.step += 1
        return float(loss.detach())

    def fit(self, max_epochs: int | None = None) -> dict:
        """Train from `start_epoch` to `epochs` (or only `max_epochs` of them). Returns a summary.
        Releases the output-dir lock at the end, however it ends."""
        try:
            return self._fit(max_epochs)
        finally:
            self.close()

    def _fit(self, max_epochs: int | None) -> dict:
        cfg = self.cfg
        stop = False
        if self.step == 0:
            stop = self.validate(epoch=-1)
        end = cfg.epochs if max_epochs is None else min(cfg.epochs, self.start_epoch + max_epochs)
        losses: list[float] = []
        for epoch in range(self.start_epoch, end):
            if stop:
                break
            self.sampler.set_epoch(epoch)
            self.train_ds.set_epoch(epoch)
            bar = tqdm(
                self.loader, desc=f"epoch {epoch}", disable=not (self.info.is_main and cfg.progress), leave=False
            )
            t0, window = time.perf_counter(), []
            for batch in bar:
                loss = self.train_one(batch)
                losses.append(loss)
                window.append(loss)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{self.sched.get_last_lr()[0]:.2e}")
                if self.info.is_main and self.step % max(cfg.log_interval, 1) == 0:
                    dt = time.perf_counter() - t0
                    rec = {
                        "kind": "train",
                        "step": self.step,
                        "epoch": epoch,
                        "loss": sum(window) / len(window),
                        "lr": self.sched.get_last_lr()[0],
                        "samples_per_s": len(window) * cfg.batch_size * self.info.world / max(dt, 1e-9),
                    }
                    _write_jsonl(self.metrics_path, rec)
                    tqdm.write(
                        f"[train] epoch {epoch} step {self.step} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                        f"{rec['samples_per_s']:.1f} samples/s"
                    )
                    t0, window = time.perf_counter(), []
                if cfg.val_every_steps and self.step % cfg.val_every_steps == 0:
                    stop = self.validate(epoch)
                    if stop:
                        break
            if not stop and not (cfg.val_every_steps and self.step % cfg.val_every_steps == 0):
                stop = self.validate(epoch)
            if self.info.is_main:
                self.save_checkpoint(epoch)
            barrier(self.info)
        return {
            "steps": self.step,
            "losses": losses,
            "best": dict(self.best),
            "early_stopped": stop,
            "output_dir": str(self.out),
        }
