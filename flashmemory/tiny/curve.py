"""Training curves from train-tiny `metrics.jsonl` files: answer loss, indexer KL and held-out accuracy."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train lines, eval lines) of one metrics.jsonl; names the line of a malformed entry."""
    train, evals = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rec["step"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path} line {n}: not a train-tiny metrics record ({e})") from None
        (evals if "eval" in rec else train).append(rec)
    return train, evals


def plot_curves(runs: dict[str, str | Path], out: str | Path) -> None:
    """One PNG: loss, KL and held-out exact-match accuracy against training time, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashmemory.atomic import atomic_path

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=110)
    for label, path in runs.items():
        train, evals = read_metrics(path)
        t = [r["elapsed_s"] for r in train]
        (line,) = axes[0].plot(t, [r["loss"] for r in train], label=label, lw=1)
        axes[1].plot(t, [r["kl"] for r in train], color=line.get_color(), lw=1)
        axes[2].plot(
            [r["elapsed_s"] for r in evals],
            [r["eval"]["acc"] for r in evals],
            marker="o",
            color=line.get_color(),
            label=f"{label}: all tasks",
        )
        if evals and "acc/niah_single" in evals[-1]["eval"]:
            axes[2].plot(
                [r["elapsed_s"] for r in evals],
                [r["eval"].get("acc/niah_single", float("nan")) for r in evals],
                ls="--",
                color=line.get_color(),
                label=f"{label}: niah_single",
            )
    axes[0].set(title="answer cross-entropy", xlabel="training seconds (H200)", yscale="log")
    axes[1].set(title="indexer KL vs main attention", xlabel="training seconds (H200)", yscale="log")
    axes[2].set(title="held-out exact match, 1024 tokens", xlabel="training seconds (H200)", ylim=(-0.02, 1.02))
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=6)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
