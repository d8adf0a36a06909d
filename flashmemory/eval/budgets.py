"""`--budgets` of every eval mode (`eval`, `eval quality`, `eval frontier`): one parser, so all refuse the same
values, and one key per budget (`budget_key`) that no two accepted budgets share."""

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
    check_distinct(tuple(out), raw)
    return tuple(out)


def budget_key(b: float) -> str:
    """A budget's name in records and reports: 6 significant digits ("0.1", "0.05", "1")."""
    return f"{b:g}"


def check_distinct(budgets: tuple[float, ...], raw: str | None = None) -> None:
    """UserError naming --budgets when two budgets share a `budget_key` (equal, or alike to 6 digits: a record
    keeps one entry per key, so the second would overwrite the first)."""
    from flashmemory.errors import UserError

    seen: dict[str, float] = {}
    for b in budgets:
        k = budget_key(b)
        if k in seen:
            given = raw if raw is not None else ",".join(map(repr, budgets))
            same = "is given twice" if seen[k] == b else f"and {seen[k]!r} both print as {k}"
            raise UserError(f"--budgets {given!r}: {b!r} {same}; give each budget once, distinct to 6 digits")
        seen[k] = b
