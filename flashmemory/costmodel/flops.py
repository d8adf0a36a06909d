"""Per-decode-token FLOPs of DeepSeek-V4-Flash, baseline (indexer scores the full history) vs FlashMemory.

Every term is a matmul written as MACs per token; FLOPs = MACs * `CountRules.flops_per_mac` (2, the
usual multiply + add; the constant part only lands near upstream's 26.6 GFLOP at 2).

Baseline   = constant + native-indexer scoring over all n_chunks = ctx/4 compressed entries (21 c4 layers)
FlashMemory = constant + native-indexer scoring over min(KMAX*64, n_chunks) resident chunks
            + Level 1 (retriever q-proj + scoring the full history at 3 layers) / tau
Attention cores (top-512 + SWA, c128 over all entries) are cheap next to the projections but are NOT
in upstream's table (its FlashMemory column grows exactly with KMAX and not with context), so they are
reported separately and only added when `count_attention_core=True`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIGA = 1e9


@dataclass(frozen=True)
class FlashShape:
    """DeepSeek-V4-Flash decode geometry (config.json); compress_ratios give 21 c4, 20 c128, 2 SWA-only layers."""

    hidden: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    q_lora: int = 1024
    o_groups: int = 8
    o_lora: int = 1024
    n_experts: int = 256
    experts_per_tok: int = 6
    n_shared: int = 1
    moe_inter: int = 2048
    vocab: int = 129280
    index_heads: int = 64
    index_dim: int = 128
    index_topk: int = 512
    window: int = 128
    hc_mult: int = 4
    n_c4: int = 21
    n_c128: int = 20
    c4_ratio: int = 4
    c128_ratio: int = 128

    def __post_init__(self) -> None:
        if self.n_c4 + self.n_c128 > self.n_layers:
            raise ValueError(f"n_c4 + n_c128 = {self.n_c4 + self.n_c128} exceeds n_layers = {self.n_layers}")
        if self.n_heads % self.o_groups:
            raise ValueError(f"n_heads {self.n_heads} must divide into o_groups {self.o_groups}")


@dataclass(frozen=True)
class RetrieverShape:
    """The Memory Indexer (Level 1): `n_layers` target c4 layers, each 4096 -> rank -> heads x head_dim."""

    n_layers: int = 3
    n_heads: int = 128
    head_dim: int = 128
    rank: int = 2048
    interval: int = 64  # tau: Level 1 runs once per this many decode steps
    page_chunks: int = 64  # chunks per recall page; the resident set is KMAX pages


@dataclass(frozen=True)
class CountRules:
    """What counts as a FLOP. Defaults are the assumptions under which upstream's table is reproduced."""

    flops_per_mac: int = 2
    count_weighting: bool = True  # the sum_h w_h * relu(q_h.k) MACs, 64 per chunk (tiny next to q.k)
    count_hc: bool = True  # mHC mixing matmuls [24, 4*4096] twice per layer
    count_level1: bool = True
    count_attention_core: bool = False


@dataclass(frozen=True)
class Term:
    """One matmul family: `macs` per token per instance, repeated `count` times (layers)."""

    name: str
    macs: float
    count: int
    note: str = ""

    def flops(self, rules: CountRules) -> float:
        return self.macs * self.count * rules.flops_per_mac


@dataclass(frozen=True)
class FlopBreakdown:
    """FLOPs per decode token (not GFLOP); `terms` lists every summand for printing."""

    constant: float
    scoring: float
    level1: float
    attention_core: float
    terms: tuple[Term, ...] = field(default_factory=tuple)

    @property
    def total(self) -> float:
        return self.constant + self.scoring + self.level1 + self.attention_core


def constant_terms(s: FlashShape, rules: CountRules = CountRules()) -> list[Term]:
    """The context-independent projections: MLA-style attention, MoE, compressors, indexer q-proj, mHC, LM head."""
    heads_per_group = s.n_heads // s.o_groups
    terms = [
        Term("attn wq_a", s.hidden * s.q_lora, s.n_layers, f"{s.hidden}->{s.q_lora}"),
        Term("attn wq_b", s.q_lora * s.n_heads * s.head_dim, s.n_layers, f"{s.q_lora}->{s.n_heads}x{s.head_dim}"),
        Term("attn wkv", s.hidden * s.head_dim, s.n_layers, f"{s.hidden}->{s.head_dim} (1 shared KV head)"),
        Term(
            "attn wo_a",
            s.o_groups * heads_per_group * s.head_dim * s.o_lora,
            s.n_layers,
            f"{s.o_groups} groups x ({heads_per_group}x{s.head_dim}->{s.o_lora})",
        ),
        Term("attn wo_b", s.o_groups * s.o_lora * s.hidden, s.n_layers, f"{s.o_groups * s.o_lora}->{s.hidden}"),
        Term("moe gate", s.hidden * s.n_experts, s.n_layers, f"{s.hidden}->{s.n_experts} (hash layers too)"),
        Term(
            "moe experts",
            (s.experts_per_tok + s.n_shared) * 3 * s.hidden * s.moe_inter,
            s.n_layers,
            f"({s.experts_per_tok}+{s.n_shared}) x SwiGLU 3x{s.hidden}x{s.moe_inter}",
        ),
        Term("c4 compressor", 2 * s.hidden * 2 * s.head_dim, s.n_c4, f"wkv+wgate {s.hidden}->2x{s.head_dim}"),
        Term("c128 compressor", 2 * s.hidden * s.head_dim, s.n_c128, f"wkv+wgate {s.hidden}->{s.head_dim}"),
        Term(
            "indexer wq_b", s.q_lora * s.index_heads * s.index_dim, s.n_c4, f"{s.q_lora}->{s.index_heads}x{s.index_dim}"
        ),
        Term("indexer weights_proj", s.hidden * s.index_heads, s.n_c4, f"{s.hidden}->{s.index_heads}"),
        Term("indexer compressor", 2 * s.hidden * 2 * s.index_dim, s.n_c4, f"wkv+wgate {s.hidden}->2x{s.index_dim}"),
        Term("lm head", s.hidden * s.vocab, 1, f"{s.hidden}->{s.vocab}"),
    ]
    if rules.count_hc:
        mix = (2 + s.hc_mult) * s.hc_mult
        terms.append(
            Term("mHC mixing", 2 * mix * s.hc_mult * s.hidden, s.n_layers, f"2 sites x [{mix}, {s.hc_mult}x{s.hidden}]")
        )
        terms.append(Term("mHC head", s.hc_mult * s.hc_mult * s.hidden, 1, f"[{s.hc_mult}, {s.hc_mult}x{s.hidden}]"))
    return terms


def score_macs_per_chunk(n_heads: int, head_dim: int, rules: CountRules) -> int:
    """MACs to score one chunk at one layer: H dot products of length D, plus the H-term weighted sum."""
    return n_heads * head_dim + (n_heads if rules.count_weighting else 0)


def n_chunks(ctx: int, s: FlashShape = FlashShape()) -> int:
    """Compressed c4 entries for a context of `ctx` tokens."""
    if ctx < 0:
        raise ValueError(f"ctx must be >= 0, got {ctx}")
    return ctx // s.c4_ratio


def resident_chunks(kmax: int, ctx: int, s: FlashShape = FlashShape(), r: RetrieverShape = RetrieverShape()) -> int:
    """Chunks the Level-2 indexer scores under FlashMemory: KMAX pages of 64, capped by the history."""
    if kmax < 1:
        raise ValueError(f"kmax must be >= 1, got {kmax}")
    return min(kmax * r.page_chunks, n_chunks(ctx, s))


def level1_terms(ctx: int, s: FlashShape, r: RetrieverShape, rules: CountRules) -> list[Term]:
    """Memory-Indexer work per decode token, i.e. one Level-1 pass divided by tau (counts as 1 instance)."""
    n = n_chunks(ctx, s)
    qproj = s.hidden * r.rank + r.rank * r.n_heads * r.head_dim + s.hidden * r.n_heads
    score = n * score_macs_per_chunk(r.n_heads, r.head_dim, rules)
    return [
        Term(
            "L1 retriever q-proj / tau",
            qproj / r.interval,
            r.n_layers,
            f"({s.hidden}->{r.rank}->{r.n_heads}x{r.head_dim}, +w {r.n_heads}) / {r.interval}",
        ),
        Term(
            "L1 retriever scoring / tau",
            score / r.interval,
            r.n_layers,
            f"{n} chunks x ({r.n_heads}x{r.head_dim}+{r.n_heads}) / {r.interval}",
        ),
    ]


def attention_core_terms(ctx: int, s: FlashShape) -> list[Term]:
    """QK^T and PV over the attended entries (head_dim 512, 64 heads). Not in upstream's table."""
    per_entry = 2 * s.n_heads * s.head_dim
    n_c128 = ctx // s.c128_ratio
    n_swa_only = s.n_layers - s.n_c4 - s.n_c128
    return [
        Term(
            "attn core c4 (top-k + SWA)",
            (min(s.index_topk, n_chunks(ctx, s)) + s.window) * per_entry,
            s.n_c4,
            f"({s.index_topk}+{s.window}) entries x 2x{s.n_heads}x{s.head_dim}",
        ),
        Term(
            "attn core c128 (all + SWA)",
            (n_c128 + s.window) * per_entry,
            s.n_c128,
            f"({n_c128}+{s.window}) entries x 2x{s.n_heads}x{s.head_dim}",
        ),
        Term("attn core SWA-only", s.window * per_entry, n_swa_only, f"{s.window} entries"),
    ]


def _breakdown(
    ctx: int, scored: int, with_level1: bool, s: FlashShape, r: RetrieverShape, rules: CountRules
) -> FlopBreakdown:
    const = constant_terms(s, rules)
    score = [
        Term(
            "indexer scoring",
            scored * score_macs_per_chunk(s.index_heads, s.index_dim, rules),
            s.n_c4,
            f"{scored} chunks x ({s.index_heads}x{s.index_dim}+{s.index_heads})",
        )
    ]
    l1 = level1_terms(ctx, s, r, rules) if with_level1 and rules.count_level1 else []
    core = attention_core_terms(ctx, s) if rules.count_attention_core else []

    def total(ts: list[Term]) -> float:
        return sum(t.flops(rules) for t in ts)

    return FlopBreakdown(
        constant=total(const),
        scoring=total(score),
        level1=total(l1),
        attention_core=total(core),
        terms=tuple(const + score + l1 + core),
    )


def baseline_flops(
    ctx: int, s: FlashShape = FlashShape(), r: RetrieverShape = RetrieverShape(), rules: CountRules = CountRules()
) -> FlopBreakdown:
    """Native V4 decode: the lightning indexer scores every compressed chunk of the history at all c4 layers."""
    return _breakdown(ctx, n_chunks(ctx, s), False, s, r, rules)


def flashmemory_flops(
    ctx: int,
    kmax: int,
    s: FlashShape = FlashShape(),
    r: RetrieverShape = RetrieverShape(),
    rules: CountRules = CountRules(),
) -> FlopBreakdown:
    """FlashMemory decode: Level 2 scores only the resident KMAX*64 chunks; Level 1 amortized over tau."""
    return _breakdown(ctx, resident_chunks(kmax, ctx, s, r), True, s, r, rules)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope): used to read upstream's implied constant and per-token cost."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"fit_line needs >= 2 paired points, got {len(xs)} and {len(ys)}")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line: all x values are equal")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope
