"""The Memory Indexer: a per-layer query encoder scored against the fp8 index keys.

score[b, n] = sigmoid( sum_h relu(q[b,h] . k[n]) * w[b,h] + logit_offset )
  q = Hadamard(YaRN-RoPE(wq_b(RMSNorm(wq_a(x)))))  [B, H, D]
  w = weights_proj(x) * D^-0.5 * H^-0.5             [B, H]
  k = fp8 * scale from the 132-byte chunk            [N, D]
All math runs in fp32 (upstream's inference casts q to bf16 around RoPE; fp32 is at least as exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashmemory.retriever.hadamard import hadamard_transform
from flashmemory.retriever.rope import RopeConfig, apply_rope

_SCORE_BLOCK = 16384  # keys scored per matmul block: bounds the [B, block, H] intermediate


@dataclass(frozen=True)
class RetrieverDims:
    """Shapes of one retriever layer. Full size: hidden 4096, rank 2048, 128 heads x 128, rope 64."""

    hidden: int = 4096
    rank: int = 2048
    n_heads: int = 128
    head_dim: int = 128
    rope_dim: int = 64

    def __post_init__(self) -> None:
        for name in ("hidden", "rank", "n_heads", "head_dim", "rope_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"RetrieverDims.{name} must be >= 1")
        if self.head_dim & (self.head_dim - 1):
            raise ValueError(f"head_dim must be a power of two (Hadamard), got {self.head_dim}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and in (0, head_dim], got {self.rope_dim}")


def relu_head_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Raw logits sum_h relu(q_h . k_n) w_h.

    q: [B, H, D] fp32, w: [B, H] fp32, keys: [N, D] (shared by all rows) or [B, N, D].
    Returns [B, N] fp32. Blocks over N so the [B, N, H] intermediate stays small.
    """
    b, h, d = q.shape
    n = keys.shape[-2]
    out = q.new_empty(b, n)
    for s in range(0, max(n, 1), _SCORE_BLOCK):
        k = keys[..., s : s + _SCORE_BLOCK, :].float()
        if k.dim() == 2:
            hs = torch.relu(k @ q.reshape(b * h, d).T).view(-1, b, h)  # [n', B, H]
            out[:, s : s + k.shape[0]] = torch.einsum("nbh,bh->bn", hs, w)
        else:
            hs = torch.relu(torch.bmm(k, q.transpose(1, 2)))  # [B, n', H]
            out[:, s : s + k.shape[1]] = torch.bmm(hs, w.unsqueeze(-1)).squeeze(-1)
    return out


class RetrieverLayer(nn.Module):
    """One target layer's query encoder. Parameter names match upstream checkpoints."""

    def __init__(self, dims: RetrieverDims, rope: RopeConfig | None = None, logit_offset: float = 0.0):
        super().__init__()
        self.dims = dims
        self.rope = rope or RopeConfig(rope_dim=dims.rope_dim)
        if self.rope.rope_dim != dims.rope_dim:
            raise ValueError(f"rope.rope_dim {self.rope.rope_dim} != dims.rope_dim {dims.rope_dim}")
        self.logit_offset = logit_offset
        self.wq_a = nn.Linear(dims.hidden, dims.rank, bias=False)
        self.q_norm_weight = nn.Parameter(torch.ones(dims.rank))
        self.wq_b = nn.Linear(dims.rank, dims.n_heads * dims.head_dim, bias=False)
        self.weights_proj = nn.Linear(dims.hidden, dims.n_heads, bias=False)

    def query(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [B, hidden] any float dtype; positions: [B] int -> (q [B, H, D] fp32, w [B, H] fp32)."""
        d = self.dims
        if hidden.dim() != 2 or hidden.shape[1] != d.hidden:
            raise ValueError(f"hidden must be [B, {d.hidden}], got {tuple(hidden.shape)}")
        x = hidden.float()
        ql = self.wq_a(x)
        ql = ql * torch.rsqrt(ql.pow(2).mean(-1, keepdim=True) + 1e-6) * self.q_norm_weight
        q = self.wq_b(ql).view(-1, d.n_heads, d.head_dim)
        q = hadamard_transform(apply_rope(q, positions, self.rope))
        w = self.weights_proj(x) * (d.head_dim**-0.5 * d.n_heads**-0.5)
        return q, w

    def logits(
        self, hidden: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, N] fp32 (offset included); columns n >= lengths[b] are -inf.

        keys: dequantized index keys, [N, D] shared or [B, N, D] per row (zero-padded past each length).
        """
        q, w = self.query(hidden, positions)
        out = relu_head_scores(q, w, keys) + self.logit_offset
        if lengths is not None:
            col = torch.arange(out.shape[1], device=out.device)
            out = out.masked_fill(col.unsqueeze(0) >= lengths.to(out.device).unsqueeze(1), float("-inf"))
        return out

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scores in [0, 1], shape [B, N]; columns past each row's length score 0."""
        return torch.sigmoid(self.logits(hidden, positions, keys, lengths))


class JointRetriever(nn.Module):
    """Retriever layers keyed by c4-layer id (10, 12, 20 at full size); state keys `retrievers.l{id}.*`."""

    def __init__(
        self,
        layers: tuple[int, ...] | list[int],
        dims: RetrieverDims,
        rope: RopeConfig | None = None,
        logit_offset: float = 0.0,
    ):
        super().__init__()
        if not layers:
            raise ValueError("JointRetriever needs at least one layer")
        self.layers = tuple(sorted(int(i) for i in layers))
        self.dims = dims
        self.rope = rope or RopeConfig(rope_dim=dims.rope_dim)
        self.retrievers = nn.ModuleDict({f"l{i}": RetrieverLayer(dims, self.rope, logit_offset) for i in self.layers})

    def layer(self, lid: int) -> RetrieverLayer:
        key = f"l{lid}"
        if key not in self.retrievers:
            raise KeyError(f"retriever has no layer {lid} (has {list(self.layers)})")
        return self.retrievers[key]

    def set_logit_offset(self, offset: float) -> None:
        for m in self.retrievers.values():
            m.logit_offset = offset

    def forward(
        self,
        hidden: dict[int, torch.Tensor],
        positions: torch.Tensor,
        keys: dict[int, torch.Tensor],
        lengths: torch.Tensor | None = None,
    ) -> dict[int, torch.Tensor]:
        """Per-layer scores {lid: [B, N]} from per-layer hidden [B, hidden] and keys ([N, D] or [B, N, D])."""
        missing = [i for i in self.layers if i not in hidden or i not in keys]
        if missing:
            raise KeyError(f"inputs lack retriever layers {missing}")
        return {i: self.layer(i)(hidden[i], positions, keys[i], lengths) for i in self.layers}
