"""`--budgets` of every eval mode (`eval`, `eval quality`): one parser, so both refuse the same values."""

from __future__ import annotations


def parse_budgets(raw: str | None) -> tuple[float, ...]:
    """--budgets '0.1,0.25': fractions of the existing chunks, each in (0, 1] (a fraction above 1 would be
    printed as asked while every policy ran at 1.0)."""
    from flashmemory.errors import UserError

    out = []
    for x in (raw or "").split(","):
        if not x.strip():
            continue
        try:
            v = float(x)
        except ValueError:
            raise UserError(
                f"--budgets {raw!r}: {x.strip()!r} is not a number (comma-separated fractions like 0.1,0.25)"
            ) from None
        if not 0.0 < v <= 1.0:  # also refuses nan and inf
            raise UserError(f"--budgets {raw!r}: {x.strip()} is not a fraction in (0, 1] of the existing chunks")
        out.append(v)
    return tuple(out)
