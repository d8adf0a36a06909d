"""Plain-text tables for the bench reports (one printer, shared by the cost-model reports)."""

from __future__ import annotations

from typing import Any


def print_table(title: str, head: list[str], rows: list[list[Any]]) -> None:
    """Print `title`, then a right-aligned table: floats with 3 decimals, everything else with str()."""
    cells = [[str(c) for c in head]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))
