"""The arms of a live run and what each one starts (pure: no server is started here).

An arm is a kind and, except for stock, a page budget b (a share of the document's pages, as in the replay frontier):
- `stock`: sglang's own decode (FLASHMEMORY=0), the live counterpart of the replay's Full.
- `FlashMemory@b`: FlashMemory on D with Level 1 (the given retriever), KMAX = ceil(b x pages) of sglang's 256-token
  pages (64 c4 chunks each), Level 1 every `tau` steps, threshold and recency tail as the replay's; in copy mode by
  default (`C4_MODES`: sglang's pool keeps every page, so a request attends its whole history until its first
  Level-1 plan publishes, as stock does) or in shrink mode (the history in host DRAM: the warm start alone until
  then).
- `HiSparse@b`: sglang's HiSparse on D with a hot buffer of the chunks FlashMemory may keep at b (KMAX x 64), and never
  fewer than the model's index top-k (HiSparse's least), as the replay frontier sizes it (`hot_slots`).
- `HiSparse+prefetch@b`: the same, with FlashMemory's Level-1 set as the buffer's prefetch hint each cycle.

Pages are coarser live than in the replay (64 chunks against 8): on a 4K document 10% is 2 of 16 pages (128 chunks,
12.5%) live and 13 of 129 pages (104 chunks) in the replay; `LiveArm.settings` records both, and the report prints
them beside each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashmemory.errors import UserError
from flashmemory.eval.budgets import budget_key

KINDS = ("stock", "FlashMemory", "HiSparse", "HiSparse+prefetch")
C4_MODES = ("copy", "shrink")  # FlashMemory's Path-P mode on D (launch_decode.sh's C4_SHRINK 0 / 1)
SERVE_PAGE_CHUNKS = 64  # sglang's DeepSeek-V4 page: 256 tokens = 64 c4 chunks (FlashMemory's KMAX counts these)
REPLAY_ROW = {
    "stock": "Full",
    "FlashMemory": "FlashMemory",
    "HiSparse": "HiSparse",
    "HiSparse+prefetch": "HiSparse+prefetch",
}


@dataclass(frozen=True)
class LiveArm:
    """One arm: `kind` in KINDS; `budget` in (0, 1] for every kind but stock (None)."""

    kind: str
    budget: float | None = None

    @property
    def key(self) -> str:
        """The arm's name in records, file names and reports: "stock", "FlashMemory@0.1", ..."""
        return self.kind if self.budget is None else f"{self.kind}@{budget_key(self.budget)}"

    def kmax(self, doc_len: int) -> int:
        """FlashMemory's KMAX at this budget on a `doc_len`-token document: ceil(b x pages of 64 chunks), >= 1."""
        pages = math.ceil(doc_len / 4 / SERVE_PAGE_CHUNKS)
        return max(1, math.ceil((self.budget or 1.0) * pages))

    def hot_slots(self, doc_len: int, index_topk: int) -> int:
        """HiSparse's hot buffer per c4 layer and request: FlashMemory's resident chunks at this budget, at least
        the top-k (sglang refuses a buffer below it); with prefetch, at least one page of hinted chunks beside the
        top-k picks (the plugin refuses a buffer the picks fill)."""
        least = index_topk + (SERVE_PAGE_CHUNKS if self.kind == "HiSparse+prefetch" else 0)
        return max(self.kmax(doc_len) * SERVE_PAGE_CHUNKS, least)

    def settings(
        self, doc_len: int, index_topk: int, tau: int, threshold: float, tail_chunks: int, c4_mode: str = "copy"
    ) -> dict:
        """What this arm's servers are started with (JSON-ready): part of every record's fingerprint."""
        s: dict = {"kind": self.kind, "budget": self.budget, "top_k": index_topk}
        if self.kind in ("FlashMemory", "HiSparse+prefetch"):
            s |= {"tau": tau, "threshold": threshold, "tail_chunks": tail_chunks}
        if self.kind == "FlashMemory":
            s["kmax_pages"] = self.kmax(doc_len)
            s["resident_chunks"] = s["kmax_pages"] * SERVE_PAGE_CHUNKS
            s["c4_mode"] = c4_mode
        if self.kind.startswith("HiSparse"):
            s["hot_slots"] = self.hot_slots(doc_len, index_topk)
        return s


def parse_arms(raw: str | None, budgets: tuple[float, ...]) -> tuple[LiveArm, ...]:
    """--arms 'stock,FlashMemory,HiSparse' x --budgets: stock once, every other kind at every budget, in the order
    given. UserError naming --arms for an unknown or repeated kind, or none."""
    kinds = [x.strip() for x in (raw or "").split(",") if x.strip()]
    if not kinds:
        raise UserError(f"--arms {raw!r}: give at least one of {', '.join(KINDS)}")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise UserError(f"--arms: unknown {', '.join(bad)}; choose from {', '.join(KINDS)}")
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        raise UserError(f"--arms: {', '.join(twice)} given more than once")
    out: list[LiveArm] = []
    for k in kinds:
        out += [LiveArm(k)] if k == "stock" else [LiveArm(k, b) for b in budgets]
    return tuple(out)
