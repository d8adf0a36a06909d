"""Train a small retriever for the serving-tiny model, the project's way: Full-attention decode with the
transformers engine, golden-label dump (`flashmemory.dump`, through `dump_runs`), `flashmemory.train` on it.
For `make serve` (`stack.ensure_retriever`), the demo's serving stage, `bench serve` and the live tests, which
need a checkpoint trained on *this* model; minutes on CPU, seeded. `dump_runs` is also the demo's stage 3.

The serving-tiny model has 2 c4 layers, so the retriever targets c4 layers (0, 1).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashmemory.eval.decode import DocRun

TARGETS = (0, 1)


@dataclass(frozen=True)
class TinyRetrieverConfig:
    n_train: int = 3
    n_val: int = 1
    prompt_len: int = 640  # tokens per document
    gen_tokens: int = 16  # greedy decode steps per document (the labelled queries)
    epochs: int = 2
    seed: int = 0
    progress: bool = True  # the training progress bar (the demo logs one line instead)


def dump_runs(
    runs: "list[DocRun]",
    out: Path,
    engine,
    targets: tuple[int, ...],
    start: int,
    *,
    topp: float,
    min_layers: int,
    max_tokens: int,
) -> None:
    """Commit `runs` (each with its capture `run.cap`) under `out` in the dump format, doc indices from `start`.

    topp / min_layers: the golden-label nucleus per layer and the layer votes a golden chunk needs; max_tokens: the
    decode steps each document was run for; engine: the `HFEngine` the runs came from (index top-k, c4 layers)."""
    from flashmemory.dump.backend import DumpConfig
    from flashmemory.dump.hf_backend import doc_from_capture
    from flashmemory.dump.writer import DumpWriter

    writer = DumpWriter(out)
    dcfg = DumpConfig(topp=topp, min_layers=min_layers, target_layers=targets, max_tokens=max_tokens)
    for i, run in enumerate(runs):
        doc = doc_from_capture(
            run.cap,
            run.prompt_ids,
            run.response_ids,
            dcfg,
            doc_index=start + i,
            rid=run.name,
            index_topk=engine.index_topk,
            n_c4_layers=engine.n_c4_layers,
        )
        writer.commit(doc, source="demo", item_index=start + i)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(26, 1024) for _ in range(n)]


def train_tiny_retriever(
    model_dir: str | Path,
    out: str | Path,
    cfg: TinyRetrieverConfig = TinyRetrieverConfig(),
    prompts: Sequence[Sequence[int]] | None = None,
) -> Path:
    """Dump cfg.n_train + cfg.n_val documents from the checkpoint at model_dir under `out/dump`, train on them
    under `out/ckpt`; returns the best-F1 checkpoint path.

    prompts: the documents' token ids (the first n_train train, the next n_val validate), for a retriever that will
    serve text like them; default: cfg.prompt_len seeded random ids each (what the live tests serve)."""
    n = cfg.n_train + cfg.n_val
    if prompts is not None and len(prompts) < n:
        raise ValueError(f"train_tiny_retriever: {len(prompts)} prompts given, {n} needed (n_train + n_val)")
    import torch

    from flashmemory.eval.decode import full_run
    from flashmemory.hf import HFEngine
    from flashmemory.train.loop import BEST_F1, TrainConfig, Trainer
    from flashmemory.train.samples import SampleConfig

    out = Path(out)
    torch.manual_seed(cfg.seed)
    engine = HFEngine.from_name(str(model_dir), dtype=torch.float32)
    docs = (
        [list(map(int, p)) for p in prompts[:n]]
        if prompts is not None
        else [_prompt(cfg.prompt_len, cfg.seed * 100 + i) for i in range(n)]
    )
    runs = [
        full_run(engine, f"doc-{i}", ids, cfg.gen_tokens, TARGETS, topp=0.6, min_layers=1) for i, ids in enumerate(docs)
    ]

    labels = dict(topp=0.6, min_layers=1, max_tokens=cfg.gen_tokens)
    dump_runs(runs[: cfg.n_train], out / "dump" / "train", engine, TARGETS, 0, **labels)
    dump_runs(runs[cfg.n_train :], out / "dump" / "val", engine, TARGETS, cfg.n_train, **labels)
    # Relative to the config file's own directory (how data configs resolve), so the config reads the same
    # wherever it is read from; a cwd-relative `out` written verbatim once resolved to out/out/dump/train.
    data = {"train": [{"data_dir": "dump/train"}], "val": [{"data_dir": "dump/val"}], "test": []}
    (out / "data_config.json").write_text(json.dumps(data, indent=1))
    tc = TrainConfig(
        data_config=str(out / "data_config.json"),
        output_dir=str(out / "ckpt"),
        no_pretrain=True,
        joint_layers=TARGETS,
        n_heads=16,
        q_lora_rank=64,
        lr=3e-3,
        epochs=cfg.epochs,
        batch_size=16,
        focal_loss=True,
        threshold=0.5,
        sample=SampleConfig(label_interval=8, max_pos=128, neg_ratio=3.0),
        seed=cfg.seed,
        device="cpu",
        log_interval=10**9,
        progress=cfg.progress,
    )
    Trainer(tc).fit()
    return out / "ckpt" / BEST_F1
