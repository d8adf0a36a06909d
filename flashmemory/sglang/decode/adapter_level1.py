"""The adapter's Level-1 calls: one decode step's cycle (`level1`) and the guard's check of its scores.

Mixed into `offload_adapter.OffloadAdapter`; the names below are the adapter's (its batch rows, the core's
`Level1`, the layout, the request map and the guard's failure factory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashmemory.offload.tiered_mirror import corrupt_page_in


class Level1Calls:
    """Mixed into `OffloadAdapter`: every attribute below is set by its `__init__` or its `begin_step`."""

    step_rows: torch.Tensor
    l1: Any
    layout: Any
    rows: dict[str, int]
    make_failure: Callable[[str, str, str], BaseException] | None

    def level1(self, snapshot: dict[str, torch.Tensor]) -> None:
        """One decode step's Level-1 call (cadence and async are Level1's). snapshot: hidden_{layer} [B, hidden]
        for the target layers (absent without a retriever), positions [B]. The cycle's pages appear in the core's
        tables when it publishes (read them with `resident_pages`).

        The tensors may be views of the runtime's static side band: `Level1.on_step` copies the due rows
        (index_select + clone) on the caller's stream, so the next forward may overwrite them. A snapshot
        shorter than the batch (side band capacity) leaves the rows beyond it out of this step's cycle."""
        rows = self.step_rows
        n = rows.numel()
        if "positions" in snapshot:
            n = min(n, snapshot["positions"].shape[0])
        try:
            if n and bool((rows[:n] >= 0).any()):
                hidden: dict[Any, torch.Tensor] = {
                    l: snapshot[f"hidden_{l}"][:n] for l in self.layout.target_layers if f"hidden_{l}" in snapshot
                }
                hidden.update(
                    {
                        ("q_lora", l): snapshot[f"q_lora_{l}"][:n]
                        for l in self.layout.target_layers
                        if f"q_lora_{l}" in snapshot
                    }
                )  # the miss monitor's native query input
                positions = snapshot.get("positions", torch.zeros(n, dtype=torch.int64))[:n]
                self.l1.on_step(rows[:n].tolist(), hidden, positions)
            else:
                self.l1.tick()  # lockstep (TP): this step counts on every rank, rows or not
        except Exception as e:
            bad = corrupt_page_in(e)
            if bad is None or self.make_failure is None:
                raise
            raise self.make_failure(bad.rid, "level1", str(bad)) from e  # the guard fails that request alone

    def check_level1_scores(self, check: Callable[[str, torch.Tensor], None]) -> None:
        """Run `check(rid, scores)` on every Level-1 score vector (float [n_hist]) before the page policy sees it;
        `check` raises to refuse them (the guard fails that request). Applied once: a second call is a no-op."""
        inner = self.l1.scorer
        if getattr(inner, "flashmemory_checked", False):
            return

        def scorer(row: int, n_hist: int, hidden: Any, position: Any) -> torch.Tensor:
            scores = inner(row, n_hist, hidden, position)
            check(next((rid for rid, r in self.rows.items() if r == row), f"row {row}"), scores)
            return scores

        scorer.flashmemory_checked = True
        self.l1.scorer = scorer
