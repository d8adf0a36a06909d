"""`flashmemory model train-tiny`: train transformers' DeepseekV4ForCausalLM to retrieve through c4 entries.

One step: a batch of curriculum documents (`flashmemory.tiny.data`) of one length, cross-entropy on the
answer tokens, plus the indexer KL (`flashmemory.tiny.indexer_kl`) on the detached indexer. Band attention
(`flashmemory.tiny.attention`) makes a full forward O(S (W + S/4)). c128 entries are dropped with
probability `hca_drop` per entry, so the retrieval has to use the c4 entries. The c4 attention stays
dense (index top-k >= every entry) until `sparse_from` of the run, then uses the config's top-k.

Progress p = max(step / steps, elapsed / time_budget_s) drives the learning rate (warm-up, cosine) and
the curriculum length, so a time-boxed run still ends at its full length and lowest rate. Resumable:
`out_dir/model` (safetensors + config), `out_dir/trainer.pt` (optimizer, step, elapsed, RNG; loaded with
weights_only=True) and `out_dir/metrics.jsonl` (one JSON line per log step; eval lines carry `eval`).
Documents are seeded by (seed, step, index), so a resumed run sees the same data it would have seen.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flashmemory.tiny.data import MIX, collate, heldout_mix, sample_doc


@dataclass(frozen=True)
class TrainTinyConfig:
    out_dir: str = "tiny_out"
    model: str = "dsv4-retrieval"  # shipped config name or .json (a fresh seeded model)
    init_from: str = ""  # a checkpoint dir whose weights start the run (fresh optimizer)
    seed: int = 0
    steps: int = 20000
    time_budget_s: float = 0.0  # 0 = no time limit
    tokens_per_step: int = 32768  # batch size = tokens_per_step // length
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.01
    kl_weight: float = 1.0
    hca_drop: float = 0.5
    tasks: tuple[str, ...] = tuple(m[0] for m in MIX)  # the training mix (weights of MIX, renormalised)
    lengths: tuple[int, ...] = (256, 512, 1024)
    length_until: tuple[float, ...] = (0.15, 0.35)  # progress at which each length (but the last) ends
    sparse_from: float = 0.8
    device: str = "auto"
    workers: int = 2  # document-generation processes (0 = in the training process)
    eval_every: int = 250
    eval_docs: int = 40  # held-out documents at the last length, per eval
    ckpt_every_s: float = 60.0
    log_every: int = 10
    progress: bool = True

    def __post_init__(self) -> None:
        if len(self.length_until) != len(self.lengths) - 1:
            raise ValueError(f"--length-until needs {len(self.lengths) - 1} values for lengths {self.lengths}")
        if any(L < 64 for L in self.lengths):
            raise ValueError(f"--lengths must be >= 64 tokens, got {self.lengths}")
        for name in ("steps", "tokens_per_step", "eval_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        unknown = [t for t in self.tasks if t not in {m[0] for m in MIX}]
        if unknown or not self.tasks:
            raise ValueError(f"--tasks: unknown or empty {unknown}; choose from {[m[0] for m in MIX]}")
        if not 0.0 <= self.hca_drop < 1.0:
            raise ValueError(f"--hca-drop must lie in [0, 1), got {self.hca_drop}")


def progress_at(step: int, elapsed: float, cfg: TrainTinyConfig) -> float:
    p = step / cfg.steps
    if cfg.time_budget_s > 0:
        p = max(p, elapsed / cfg.time_budget_s)
    return min(p, 1.0)


def length_at(p: float, cfg: TrainTinyConfig) -> int:
    for L, until in zip(cfg.lengths, cfg.length_until):
        if p < until:
            return L
    return cfg.lengths[-1]


def lr_at(step: int, p: float, cfg: TrainTinyConfig) -> float:
    warm = min(1.0, (step + 1) / max(cfg.warmup, 1))
    cos = cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
    return cfg.lr * warm * cos


def make_batch(args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(seed, step, length, batch, tasks) -> collated (input_ids, labels); runs in worker processes."""
    seed, step, length, bsz, tasks = args
    from flashmemory.tiny.evaluate import pad_id

    mix = tuple(m for m in MIX if m[0] in tasks)
    return collate([sample_doc(length, f"train:{seed}:{step}:{b}", mix) for b in range(bsz)], pad_id())


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here")
    return torch.device(name)


class Batches:
    """Prefetches batches from a process pool (or builds them inline with workers=0)."""

    def __init__(self, workers: int, depth: int = 8):
        self.pool = None
        if workers > 0:
            import multiprocessing as mp

            self.pool = mp.get_context("fork").Pool(workers, initializer=torch.set_num_threads, initargs=(1,))
        self.depth = depth
        self.queue: deque = deque()

    def get(self, key: tuple, upcoming) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch for `key`; `upcoming()` yields the next keys in order, prefetched up to `depth`."""
        if self.pool is None:
            return make_batch(key)
        while self.queue and self.queue[0][0] != key:  # stale prefetch (the length changed): drop it
            self.queue.popleft()
        if not self.queue:
            self.queue.append((key, self.pool.apply_async(make_batch, (key,))))
        queued = {k for k, _ in self.queue}
        for k in upcoming():
            if len(self.queue) >= self.depth:
                break
            if k not in queued:
                self.queue.append((k, self.pool.apply_async(make_batch, (k,))))
        return self.queue.popleft()[1].get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


class TrainLock:
    """An exclusive flock on out_dir/.lock: two runs never write one directory."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.fh = open(out / ".lock", "w")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.close()
            raise RuntimeError(f"{out}: another train-tiny run holds this output directory") from None

    def release(self) -> None:
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def save_checkpoint(model, out: Path, opt, state: dict) -> None:
    """Atomically replace out/model (eager attention, config top-k) and out/trainer.pt."""
    from flashmemory.atomic import atomic_path
    from flashmemory.tiny.attention import use_band_attention

    use_band_attention(model, False)
    tmp = out / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    use_band_attention(model, True)
    old = out / ".model.old"
    shutil.rmtree(old, ignore_errors=True)
    if (out / "model").exists():
        os.replace(out / "model", old)
    os.replace(tmp, out / "model")
    shutil.rmtree(old, ignore_errors=True)
    with atomic_path(out / "trainer.pt") as p:
        torch.save({"optimizer": opt.state_dict(), **state}, p)


def append_jsonl(path: Path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()


def check_finite(x: torch.Tensor, what: str, step: int) -> None:
    if not torch.isfinite(x).all():
        raise FloatingPointError(f"step {step}: {what} is not finite ({x.item() if x.numel() == 1 else 'tensor'})")


def train_tiny(cfg: TrainTinyConfig, log=print) -> dict:
    """Train (or resume) into cfg.out_dir; returns the last eval summary."""
    from tqdm import tqdm

    from flashmemory.hf.models import load_model
    from flashmemory.tiny.attention import use_band_attention
    from flashmemory.tiny.evaluate import score_docs, summarize
    from flashmemory.tiny.indexer_kl import IndexerKL, set_index_topk

    out = Path(cfg.out_dir)
    lock = TrainLock(out)
    batches = Batches(cfg.workers)  # fork before any CUDA initialisation
    try:
        device = pick_device(cfg.device)
        resume = (out / "model" / "config.json").is_file() and (out / "trainer.pt").is_file()
        if resume:
            model, config = load_model(str(out / "model"))
            st = torch.load(out / "trainer.pt", map_location="cpu", weights_only=True)
            saved = json.loads((out / "train_config.json").read_text())
            if saved.get("seed") != cfg.seed or saved.get("model") != cfg.model:
                raise ValueError(
                    f"{out}: resuming needs the same --seed and --model as the saved run "
                    f"({saved.get('seed')}, {saved.get('model')})"
                )
        else:
            model, config = load_model(cfg.init_from or cfg.model, seed=cfg.seed)
            st = None
            (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1))
        model.to(device).train()
        use_band_attention(model, True)
        from flashmemory.hf.layers import HCA

        for layer, kind in zip(model.model.layers, config.layer_types):
            layer.self_attn._fm_drop_comp = cfg.hca_drop if kind == HCA else 0.0
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        step, elapsed = 0, 0.0
        if st is not None:
            opt.load_state_dict(st["optimizer"])
            step, elapsed = int(st["step"]), float(st["elapsed"])
            torch.set_rng_state(st["rng"])
            log(f"resumed {out} at step {step} ({elapsed:.0f} s trained)")
        torch.manual_seed(cfg.seed * 7919 + step)
        cuda = device.type == "cuda"
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        eval_docs = heldout_mix(
            cfg.lengths[-1], max(1, cfg.eval_docs // len(cfg.tasks)), seed=cfg.seed + 1000, tasks=cfg.tasks
        )
        n_params = sum(p.numel() for p in model.parameters())
        log(
            f"train-tiny: {n_params / 1e6:.2f} M params, {len(config.layer_types)} layers {config.layer_types}, "
            f"device {device}, out {out}"
        )
        last_eval: dict = {}
        kl = IndexerKL(model, config)
        bar = tqdm(total=cfg.steps, initial=step, disable=not cfg.progress, desc="train-tiny", dynamic_ncols=True)
        t_ckpt = time.monotonic()
        sparse = None
        with kl:
            while step < cfg.steps:
                p = progress_at(step, elapsed, cfg)
                if p >= 1.0:
                    break
                t0 = time.monotonic()
                L = length_at(p, cfg)
                bsz = max(1, cfg.tokens_per_step // L)
                want_sparse = p >= cfg.sparse_from
                if want_sparse != sparse:
                    set_index_topk(model, config, config.index_topk if want_sparse else 1 << 30)
                    sparse = want_sparse
                upcoming = lambda s=step, L=L, b=bsz: ((cfg.seed, s + 1 + i, L, b, cfg.tasks) for i in range(16))
                ids, labels = batches.get((cfg.seed, step, L, bsz, cfg.tasks), upcoming)
                ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                lr = lr_at(step, p, cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
                    logits = model(input_ids=ids, use_cache=False).logits
                    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
                    kl_loss = kl.loss()
                loss = ce + cfg.kl_weight * kl_loss
                check_finite(loss.detach(), "loss", step)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                kl.clear()
                step += 1
                elapsed += time.monotonic() - t0
                bar.update(1)
                if step % cfg.log_every == 0 or step == 1:
                    with torch.no_grad():
                        m = labels != -100
                        tok_acc = float((logits.argmax(-1)[m] == labels[m]).float().mean())
                    rec = {
                        "step": step,
                        "elapsed_s": round(elapsed, 2),
                        "progress": round(p, 4),
                        "length": L,
                        "batch": bsz,
                        "lr": lr,
                        "loss": float(ce.detach()),
                        "kl": float(kl_loss.detach()),
                        "tok_acc": tok_acc,
                        "grad_norm": float(gnorm),
                        "sparse": sparse,
                    }
                    append_jsonl(out / "metrics.jsonl", rec)
                    bar.set_postfix(L=L, loss=f"{rec['loss']:.3f}", kl=f"{rec['kl']:.3f}", acc=f"{tok_acc:.2f}")
                done = step >= cfg.steps or progress_at(step, elapsed, cfg) >= 1.0
                if step % cfg.eval_every == 0 or done:
                    model.eval()
                    set_index_topk(model, config, config.index_topk)
                    res = score_docs(model, eval_docs, 16, device, autocast=cuda)
                    kl.clear()
                    set_index_topk(model, config, config.index_topk if sparse else 1 << 30)
                    model.train()
                    last_eval = summarize(res)
                    append_jsonl(
                        out / "metrics.jsonl", {"step": step, "elapsed_s": round(elapsed, 2), "eval": last_eval}
                    )
                    bar.write(
                        f"step {step}: held-out {cfg.lengths[-1]}-token acc {last_eval['acc']:.3f} "
                        + " ".join(f"{k[4:]}={v:.2f}" for k, v in last_eval.items() if k.startswith("acc/"))
                    )
                if done or time.monotonic() - t_ckpt >= cfg.ckpt_every_s:
                    save_checkpoint(model, out, opt, {"step": step, "elapsed": elapsed, "rng": torch.get_rng_state()})
                    t_ckpt = time.monotonic()
        bar.close()
        if (out / "model").exists():
            save_checkpoint(model, out, opt, {"step": step, "elapsed": elapsed, "rng": torch.get_rng_state()})
        return {"step": step, "elapsed_s": elapsed, **last_eval}
    finally:
        batches.close()
        lock.release()
