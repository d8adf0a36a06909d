"""Demo configuration: one frozen dataclass; `--quick` and the test preset are named instances."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashmemory.tasks.suite import TASKS


@dataclass(frozen=True)
class DemoConfig:
    model: str = "tiny-flash"          # shipped tiny model (43-layer Flash pattern) or a local checkpoint dir
    out_dir: str = "demo_out"
    seed: int = 0
    tasks: tuple[str, ...] = tuple(TASKS)
    doc_len: int = 1024                # prompt tokens per document (tiny word-level tokenizer)
    gen_tokens: int = 48               # greedy decode steps per document
    n_train: int = 8                   # documents the retriever trains on
    n_val: int = 1                     # checkpoint selection
    n_test: int = 3                    # documents the table is measured on (never trained or selected on)
    tau: int = 16                      # Level-1 interval, decode steps (64 in serving; short demo decodes)
    page_chunks: int = 8               # chunks per page (64 in serving; tiny documents have few chunks)
    budget: float = 0.15               # KMAX as a fraction of a test document's pages
    tail_chunks: int = 8               # recency tail, chunks (one page)
    threshold: float = 0.5
    topp: float = 0.6
    min_layers: int = 3
    target_layers: tuple[int, ...] = ()  # () = 10,12,20 when the model has 21 c4 layers, else the last three
    epochs: int = 20
    n_heads: int = 16                  # retriever heads (128 at full size)
    q_lora_rank: int = 64              # retriever rank (2048 at full size)
    lr: float = 3e-3
    batch_size: int = 16
    sweep: tuple[float, ...] = (0.05, 0.1, 0.15, 0.25, 0.4, 0.6)  # budgets for the coverage plot
    plot: bool = True
    serve: bool = False                # stage 7: serve the trained retriever in live sglang (PD on CPU)
    serve_kmax: int = 1                # resident pages (64 chunks) per request on the live server

    def __post_init__(self) -> None:
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"--budget must lie in (0, 1], got {self.budget}")
        bad = [b for b in self.sweep if not 0.0 < b <= 1.0]
        if bad:
            raise ValueError(f"--sweep budgets must lie in (0, 1], got {bad}")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
        for name in ("doc_len", "gen_tokens", "n_train", "n_val", "n_test", "tau", "page_chunks", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.doc_len < 64:
            raise ValueError(f"--doc-len {self.doc_len} is too short for the task suite (>= 64 tokens)")

    @property
    def n_docs(self) -> int:
        return self.n_train + self.n_val + self.n_test


QUICK = dict(model="tiny-flash", doc_len=512, gen_tokens=32, n_train=4, n_val=1, n_test=2, epochs=10, min_layers=2, budget=0.25,
             sweep=(0.1, 0.25, 0.5))
TEST = dict(model="micro", doc_len=192, gen_tokens=16, n_train=2, n_val=1, n_test=1, epochs=1, min_layers=2,
            tau=8, page_chunks=4, tail_chunks=8, sweep=(0.25, 0.5), plot=False)


def preset(cfg: DemoConfig, name: str | None) -> DemoConfig:
    """Apply a named preset (`quick`, `test`) on top of `cfg`."""
    if name is None:
        return cfg
    table = {"quick": QUICK, "test": TEST}
    if name not in table:
        raise ValueError(f"unknown preset {name!r}")
    return replace(cfg, **table[name])
