"""`flashmemory bench train`: training throughput and peak memory vs the forward-only cost.

Full-size retriever dims (hidden 4096, q-LoRA rank 2048, 128 heads x 128) on random data shaped
like training batches (batch 8, n chunks per sample). Baseline: the forward-only (no_grad) cost of
the same batch, measured in the same run; the table gives train/forward ratios. Peak memory: CUDA
max_memory_allocated on GPU; on CPU the growth of RSS (sampled every 5 ms) above its level at the start of each
phase (forward first, so the training phase's growth includes gradients and AdamW state).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time

import torch

from flashmemory.retriever.model import JointRetriever, RetrieverDims
from flashmemory.train.setup import LogitsHead, TrainConfig, batch_loss


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="1 layer, 256 chunks per sample, 2 timed steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunks", type=int, default=1024, help="chunks scored per sample (positives + negatives)")
    p.add_argument("--layers", type=int, default=3, help="jointly trained layers")
    p.add_argument("--steps", type=int, default=5, help="timed steps per phase")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rank", type=int, default=2048)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def _rss_now_mib() -> float:
    """Current resident set size; falls back to the process peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb / (1024 * 1024) if sys.platform == "darwin" else kb / 1024


class _PeakRSS:
    """Peak RSS above the level at entry, sampled every few ms on a thread. Unlike ru_maxrss it is not
    masked by an earlier, larger peak of the same process (e.g. another benchmark in `bench all`)."""

    def __enter__(self) -> "_PeakRSS":
        self.base = self.peak = _rss_now_mib()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_now_mib())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_now_mib())

    @property
    def growth_mib(self) -> float:
        return self.peak - self.base


def _batch(b: int, n: int, layers: tuple[int, ...], dims: RetrieverDims, dev: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": {L: torch.randn(b, dims.hidden, generator=g).to(dev) for L in layers},
        "positions": torch.randint(0, 131072, (b,), generator=g).to(dev),
        "keys": {L: torch.randn(b, n, dims.head_dim, generator=g).to(dev) for L in layers},
        "target": (torch.rand(b, n, generator=g) < 0.25).float().to(dev),
        "weight": torch.ones(b, n, device=dev),
        "mask": torch.ones(b, n, dtype=torch.bool, device=dev),
    }


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run(args: argparse.Namespace) -> int:
    dev = torch.device(args.device)
    n_layers, n, steps = (1, 256, 2) if args.quick else (args.layers, args.chunks, args.steps)
    dims = RetrieverDims(hidden=args.hidden, rank=args.rank, n_heads=args.heads, head_dim=128, rope_dim=64)
    layers = tuple(range(n_layers))
    torch.manual_seed(0)
    model = JointRetriever(layers, dims).to(dev)
    head = LogitsHead(model)
    cfg = TrainConfig(data_config="-", bf16=args.bf16, focal_loss=True)
    batch = _batch(args.batch_size, n, layers, dims, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_params = sum(p.numel() for p in model.parameters())

    def fwd() -> None:
        with torch.no_grad():
            batch_loss(head, batch, cfg, dev)

    def train() -> None:
        loss = batch_loss(head, batch, cfg, dev)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    res = {}
    for name, fn in (("forward", fwd), ("train", train)):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        with _PeakRSS() as rss:
            fn()  # warm-up (allocates AdamW state in the train phase)
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            _sync(dev)
            dt = (time.perf_counter() - t0) / steps
        mem = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else rss.growth_mib
        res[name] = (args.batch_size / dt, dt, mem)
    print(
        f"retriever: {n_layers} layer(s) x (hidden {dims.hidden}, rank {dims.rank}, {dims.n_heads} heads x "
        f"{dims.head_dim}); {n_params / 1e6:.1f} M params; batch {args.batch_size} x {n} chunks; {dev}"
        f"{' bf16' if args.bf16 else ''}"
    )
    mem_kind = "peak alloc MiB" if dev.type == "cuda" else "peak RSS growth MiB"
    print(f"{'phase':>8} {'samples/s':>10} {'ms/step':>9} {mem_kind:>20}")
    for name, (sps, dt, mem) in res.items():
        print(f"{name:>8} {sps:10.1f} {dt * 1e3:9.1f} {mem:20.1f}")
    f, t = res["forward"], res["train"]
    print(f"ratio train/forward: time {t[1] / f[1]:.2f}x (forward-only = 1.00x)")
    return 0
