"""Per-token label lists in compressed-sparse-row form.

Token t's labels are `indices[pointers[t]:pointers[t+1]]` with their `scores` (layer votes for golden
labels, or the window maximum for a lookahead union). Invariants: all three are int32, `pointers` has
T+1 entries, starts at 0, never decreases and ends at len(indices); indices and scores are 1-D and
equally long; indices are >= 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LabelsError(ValueError):
    """A label CSR is malformed (wrong dtype, shape, or pointers that do not describe the rows)."""


@dataclass(frozen=True)
class LabelsCSR:
    indices: torch.Tensor  # [E] int32 chunk ids
    scores: torch.Tensor  # [E] int32
    pointers: torch.Tensor  # [T+1] int32

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, what: str = "labels") -> None:
        for name in ("indices", "scores", "pointers"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise LabelsError(f"{what}: {name} must be a 1-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
            if t.dtype != torch.int32:
                raise LabelsError(f"{what}: {name} must be int32, got {t.dtype}")
        if self.indices.numel() != self.scores.numel():
            raise LabelsError(
                f"{what}: indices has {self.indices.numel()} entries but scores has {self.scores.numel()}"
            )
        p = self.pointers
        if p.numel() < 1 or int(p[0]) != 0 or int(p[-1]) != self.indices.numel():
            raise LabelsError(
                f"{what}: pointers must start at 0 and end at {self.indices.numel()} "
                f"(got {p.numel()} pointers, first/last "
                f"{p[:1].tolist()}/{p[-1:].tolist()})"
            )
        if p.numel() > 1 and bool((p[1:] < p[:-1]).any()):
            raise LabelsError(f"{what}: pointers decrease at row {int((p[1:] < p[:-1]).nonzero()[0])}")
        if self.indices.numel() and int(self.indices.min()) < 0:
            raise LabelsError(f"{what}: negative chunk index {int(self.indices.min())}")

    @property
    def n_tokens(self) -> int:
        return self.pointers.numel() - 1

    @property
    def counts(self) -> torch.Tensor:
        """[T] int64 labels per token."""
        return (self.pointers[1:] - self.pointers[:-1]).long()

    def row(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, scores) of token t, both int32 views."""
        if not 0 <= t < self.n_tokens:
            raise IndexError(f"token {t} outside [0, {self.n_tokens})")
        a, b = int(self.pointers[t]), int(self.pointers[t + 1])
        return self.indices[a:b], self.scores[a:b]

    def row_ids(self) -> torch.Tensor:
        """[E] int64: the token each entry belongs to."""
        return torch.repeat_interleave(torch.arange(self.n_tokens), self.counts)

    def to_rows(self) -> list[list[tuple[int, int]]]:
        """Plain Python form: per token a list of (chunk, score). For tests and debugging, not hot paths."""
        idx, sc, p = self.indices.tolist(), self.scores.tolist(), self.pointers.tolist()
        return [list(zip(idx[p[t] : p[t + 1]], sc[p[t] : p[t + 1]])) for t in range(self.n_tokens)]

    @classmethod
    def from_rows(cls, rows: list[list[tuple[int, int]]]) -> "LabelsCSR":
        flat = [e for r in rows for e in r]
        ptr = [0]
        for r in rows:
            ptr.append(ptr[-1] + len(r))
        return cls(
            torch.tensor([c for c, _ in flat], dtype=torch.int32),
            torch.tensor([s for _, s in flat], dtype=torch.int32),
            torch.tensor(ptr, dtype=torch.int32),
        )

    @classmethod
    def from_entries(cls, row: torch.Tensor, idx: torch.Tensor, score: torch.Tensor, n_tokens: int) -> "LabelsCSR":
        """Build from entries already grouped by row (row ascending): row/idx/score [E] integer tensors."""
        counts = (
            torch.bincount(row.long(), minlength=n_tokens) if row.numel() else torch.zeros(n_tokens, dtype=torch.long)
        )
        if counts.numel() != n_tokens:
            raise LabelsError(f"entry row ids reach {counts.numel() - 1} but n_tokens is {n_tokens}")
        ptr = torch.zeros(n_tokens + 1, dtype=torch.int64)
        ptr[1:] = torch.cumsum(counts, 0)
        return cls(idx.to(torch.int32).contiguous(), score.to(torch.int32).contiguous(), ptr.to(torch.int32))

    @classmethod
    def empty(cls, n_tokens: int) -> "LabelsCSR":
        z = torch.zeros(0, dtype=torch.int32)
        return cls(z, z.clone(), torch.zeros(n_tokens + 1, dtype=torch.int32))
