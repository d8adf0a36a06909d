"""Pure parts of `flashmemory bench peers`: counted costs per decode token from D's /metrics, device-resident bytes
per request, the steady-window check, token equality against stock, argument parsing and the side-by-side table.

Everything here is arithmetic on numbers the bench read from the servers (or from the served model's config);
nothing starts a process. Entry sizes are DeepSeek-V4's: a c4 KV entry is 584 B (448 fp8 nope + 64 bf16 rope + 8 B
of scales, the HiSparse host pool's per-entry unit) and an index-K entry is index_head_dim fp8 bytes + a 4-B scale.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashmemory.errors import UserError

ARMS = ("stock", "hisparse", "hs_prefetch", "flashmemory", "fm_monitor")
ARM_NAMES = {
    "stock": "stock",
    "hisparse": "HiSparse",
    "hs_prefetch": "HiSparse+prefetch",
    "flashmemory": "FlashMemory",
    "fm_monitor": "FlashMemory+monitor",
}
HOT_ARMS = ("hisparse", "hs_prefetch")  # the arms with a hot buffer: one stack per buffer size
KV_ENTRY_BYTES = 584
PAGE_ENTRIES = 64  # FlashMemory's page: 64 c4 entries
HS = "flashmemory_hisparse_swapin_"
HP = "flashmemory_hisparse_prefetch_"
FM = "flashmemory_"


class PeersArgError(UserError):
    """A bad command-line value; the message is one line naming the flag."""


MAX_CONTEXT = 1 << 20  # prompt tokens: the longest context the served model's RoPE table is built for
MAX_REQUESTS = 256  # concurrent requests per round (a CPU stack holds a handful)


def arm_key(arm: str, buffer: int | None = None) -> str:
    """The key of an arm's stack and records: 'hisparse@640' for a hot-buffer arm at a buffer size, the bare
    arm name otherwise (and for runs with one buffer size before the key carried it)."""
    return f"{arm}@{buffer}" if buffer is not None and arm in HOT_ARMS else arm


def split_arm(key: str) -> tuple[str, int | None]:
    """'hs_prefetch@640' -> ('hs_prefetch', 640); 'stock' -> ('stock', None). ValueError for an unknown arm."""
    arm, _, buf = key.partition("@")
    if arm not in ARMS or (buf and arm not in HOT_ARMS):
        raise ValueError(f"unknown arm {key!r}; expected one of {', '.join(ARMS)} (hot-buffer arms as NAME@SLOTS)")
    return arm, int(buf) if buf else None


def arm_label(key: str) -> str:
    """The table's name of an arm key: 'HiSparse+prefetch (640)' for 'hs_prefetch@640'."""
    arm, buf = split_arm(key)
    return ARM_NAMES[arm] + (f" ({buf})" if buf is not None else "")


def arm_order(key: str) -> tuple[int, int]:
    """Sort key: arms in ARMS order, a hot-buffer arm's sizes ascending."""
    arm, buf = split_arm(key)
    return ARMS.index(arm), buf or 0


@dataclass(frozen=True)
class Shape:
    """What the counted costs need from the served model: c4 layers, native top-k, bytes per entry."""

    n_c4: int
    index_topk: int
    index_entry_bytes: int
    kv_entry_bytes: int = KV_ENTRY_BYTES
    c4_ratio: int = 4


def shape_from_config(cfg: Mapping[str, Any]) -> Shape:
    """Shape of a DeepSeek-V4 HF config dict (compress_ratios: 4 marks a c4 layer)."""
    try:
        ratios = list(cfg["compress_ratios"])
        return Shape(
            n_c4=sum(1 for r in ratios if int(r) == 4),
            index_topk=int(cfg["index_topk"]),
            index_entry_bytes=int(cfg["index_head_dim"]) + 4,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise PeersArgError(f"model config.json: missing or bad field {e}") from None


@dataclass(frozen=True)
class Knobs:
    """The arms' settings: FlashMemory's page budget and Level-1 interval and retriever layers, HiSparse's buffer."""

    kmax: int
    interval: int
    retriever_layers: int
    hot_buffer: int


def parse_contexts(text: str) -> list[int]:
    """'2048,4096' -> [2048, 4096]: positive, increasing, no repeats; PeersArgError (one line) otherwise."""
    try:
        out = [int(x) for x in text.split(",")]  # an empty entry ('2048,,4096') is an error too
    except ValueError:
        raise PeersArgError(f"--contexts {text!r}: expected comma-separated integers, e.g. 2048,4096") from None
    if not out or any(c < 64 for c in out) or out != sorted(set(out)):
        raise PeersArgError(f"--contexts {text!r}: expected increasing prompt lengths of at least 64 tokens")
    if out[-1] > MAX_CONTEXT:
        raise PeersArgError(f"--contexts {text!r}: {out[-1]:,} tokens is more than {MAX_CONTEXT:,}")
    return out


def parse_arms(text: str) -> list[str]:
    """'stock,hisparse' -> the arms to run, in ARMS order; stock is required (every arm's tokens are compared
    with it). PeersArgError (one line) for an unknown or missing name."""
    names = [x.strip() for x in text.split(",")]
    bad = [n for n in names if n not in ARMS]
    if bad or not names:
        raise PeersArgError(
            f"--arms {text!r}: unknown arm {bad[0] if bad else ''!r}; expected some of {','.join(ARMS)}"
        )
    if "stock" not in names:
        raise PeersArgError(f"--arms {text!r}: must include stock (the reference for tokens equal to stock)")
    return [a for a in ARMS if a in names]


def parse_buffers(text: str, topk: int, prefetch: bool) -> list[int]:
    """'576,640' -> HiSparse's hot-buffer sizes (slots per c4 layer and request), one or two, increasing; each
    at least the model's top-k (sglang refuses less) and, when the prefetch arm runs, above it (a prefetch needs
    buffer - top-k free slots). PeersArgError (one line) naming --hisparse-buffer otherwise."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise PeersArgError(f"--hisparse-buffer {text!r}: expected one or two slot counts, e.g. 576,640") from None
    if not 1 <= len(out) <= 2 or out != sorted(set(out)):
        raise PeersArgError(f"--hisparse-buffer {text!r}: expected one or two increasing slot counts")
    for b in out:
        check_hot_buffer(b, topk)
        if prefetch and b <= topk:
            raise PeersArgError(
                f"--hisparse-buffer {b}: the HiSparse+prefetch arm needs more slots than the "
                f"model's index_topk ({topk}) to prefetch into"
            )
    return out


def check_args(requests: int, repeats: int, kmax: int, steady_tokens: int) -> None:
    """Raise PeersArgError naming the first bad flag."""
    for flag, v, lo, hi in (
        ("--requests", requests, 1, MAX_REQUESTS),
        ("--repeats", repeats, 1, 1000),
        ("--kmax", kmax, 1, MAX_CONTEXT // 256),
        ("--steady-tokens", steady_tokens, 2, MAX_CONTEXT),
    ):
        if not lo <= v <= hi:
            raise PeersArgError(f"{flag} {v}: must lie in [{lo}, {hi:,}]")


SWA_RATIO = 0.1  # sglang sets --swa-full-tokens-ratio 0.1 for DeepseekV4ForCausalLM (D's log: "Setting ...")
SWA_SLACK = 512  # tokens per request beyond max_new for D's SWA admission (the window tail, page rounding)


def pool_tokens(longest_ctx: int, max_new: int, requests: int, swa_ratio: float = SWA_RATIO) -> int:
    """The pool (--max-total-tokens) each server gets so that every round's requests are admitted at once.

    Two bounds: the full pool holds every request's prompt + max_new (+256); and D's SWA pool, swa_ratio of the
    full one, must hold each request's max_new + SWA_SLACK, because D's prealloc admits a PD request only when
    its SWA tail plus max_new fits (disaggregation/decode.py:1560-1567). With --tokens 2048 and a 10,240-token pool
    the SWA pool was 1,024 tokens: D never admitted the requests and P's bootstrap timed out after 300 s."""
    full = requests * (longest_ctx + max_new + 256) + 1024
    swa = int(-(-requests * (max_new + SWA_SLACK) // swa_ratio)) + 1024
    return max(full, swa)


def check_hot_buffer(hot_buffer: int, topk: int) -> None:
    """HiSparse's buffer must hold the native top-k (sglang refuses less); PeersArgError naming the flag."""
    if hot_buffer < topk:
        raise PeersArgError(
            f"--hisparse-buffer {hot_buffer}: must be at least the model's index_topk ({topk}); "
            "sglang refuses a smaller buffer"
        )


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Counter deltas over a round (names ending in _total); a counter absent before counts from 0."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.endswith("_total")}


def entries(ctx: int, shape: Shape) -> int:
    """c4 entries of a `ctx`-token history (one per c4_ratio tokens)."""
    return ctx // shape.c4_ratio


def device_bytes(key: str, ctx: int, shape: Shape, knobs: Knobs, budget_pages: float | None = None) -> dict[str, float]:
    """Device-resident bytes per request of the c4 attention state, split c4 KV / index-K / reserve-or-hot-buffer
    (config arithmetic; every other region is the same in all arms). Index-K stays on the device at full length in
    every arm (HiSparse keeps the indexer pool on the device; Path-I is off here). FlashMemory's c4 KV lives in its
    reserve (shrink mode): budget pages x 64 entries per c4 layer, capped by the history; `budget_pages` is the
    measured mean budget (the monitor widens it), KMAX otherwise. HiSparse: device_buffer_size + 64 slots per
    c4 layer, allocated whole at admission however short the history (the key's size, else knobs.hot_buffer);
    HiSparse+prefetch holds the same buffer (its hint buffers are a few int32 rows per request slot)."""
    arm, buf = split_arm(key)
    n = entries(ctx, shape)
    idx = float(shape.n_c4 * n * shape.index_entry_bytes)
    if arm == "stock":
        return {"c4_kv": float(shape.n_c4 * n * shape.kv_entry_bytes), "index_k": idx, "reserve": 0.0}
    if arm in HOT_ARMS:
        hot = buf if buf is not None else knobs.hot_buffer
        return {"c4_kv": 0.0, "index_k": idx, "reserve": float(shape.n_c4 * (hot + 64) * shape.kv_entry_bytes)}
    if arm in ("flashmemory", "fm_monitor"):
        pages = knobs.kmax if budget_pages is None or not math.isfinite(budget_pages) else budget_pages
        return {
            "c4_kv": 0.0,
            "index_k": idx,
            "reserve": float(shape.n_c4 * min(n, pages * PAGE_ENTRIES) * shape.kv_entry_bytes),
        }
    raise ValueError(f"unknown arm {arm!r}; expected one of {', '.join(ARMS)}")


def per_token_costs(
    key: str,
    d: Mapping[str, float],
    tokens: int,
    ctx: int,
    shape: Shape,
    knobs: Knobs,
    resident_fraction: float | None = None,
) -> dict[str, float]:
    """Counted costs per decode token of one arm over one round.

    d: counter deltas of D's /metrics over the round (`delta`); tokens: decode tokens D produced in it (> 0);
    ctx: prompt length (the history; the few decoded tokens are ignored). Returns
    - h2d_bytes: host -> device bytes on the step's critical path (HiSparse's on-demand swap-in of missed picks;
      FlashMemory's recalls);
    - prefetch_bytes: host -> device bytes a prefetch copied ahead of need, off the critical path (HiSparse+prefetch);
    - hit_rate: the hot buffer's demand hits over picks looked up (NaN for arms without a hot buffer);
    - transfer_ops: swap-in calls (one per c4 layer per step) plus prefetch calls for the hot-buffer arms;
      recalled pages for FlashMemory;
    - moved_entries: c4 entries carried host -> device (misses plus prefetched entries; recalled pages x 64);
    - scored_entries: c4 entries the indexers scored, all c4 layers: the native indexer's history for
      stock/HiSparse, plus for HiSparse+prefetch Level 1's retriever over the history at its layers once per
      `knobs.interval` steps (arithmetic: the hint source exports no cycle counter); FlashMemory's resident set at
      every c4 layer plus Level 1's counted cycles, plus the monitor's one native layer per monitored cycle."""
    if tokens <= 0:
        raise ValueError(f"tokens={tokens}: a round with no decode tokens has no per-token cost")
    arm, _ = split_arm(key)
    n = entries(ctx, shape)
    full = float(shape.n_c4 * n)
    nan = float("nan")
    if arm == "stock":
        return {
            "h2d_bytes": 0.0,
            "prefetch_bytes": 0.0,
            "hit_rate": nan,
            "transfer_ops": 0.0,
            "moved_entries": 0.0,
            "scored_entries": full,
        }
    if arm in HOT_ARMS:
        lookups = d.get(HS + "lookups_total", 0.0)
        pf = arm == "hs_prefetch"
        level1 = knobs.retriever_layers * n / knobs.interval if pf else 0.0
        return {
            "h2d_bytes": d.get(HS + "bytes_h2d_total", 0.0) / tokens,
            "prefetch_bytes": d.get(HP + "bytes_h2d_total", 0.0) / tokens if pf else 0.0,
            "hit_rate": d.get(HS + "hits_total", 0.0) / lookups if lookups > 0 else nan,
            "transfer_ops": (d.get(HS + "calls_total", 0.0) + (d.get(HP + "calls_total", 0.0) if pf else 0.0)) / tokens,
            "moved_entries": (d.get(HS + "misses_total", 0.0) + (d.get(HP + "loaded_total", 0.0) if pf else 0.0))
            / tokens,
            "scored_entries": full + level1,
        }
    if arm in ("flashmemory", "fm_monitor"):
        frac = resident_fraction if resident_fraction is not None and math.isfinite(resident_fraction) else None
        resident = n * frac if frac is not None else min(n, knobs.kmax * PAGE_ENTRIES)
        level1 = d.get(FM + "level1_cycles_total", 0.0) * knobs.retriever_layers * n / tokens
        monitor = d.get(FM + "monitor_cycles_total", 0.0) * n / tokens
        pages = d.get(FM + "recall_pages_total", 0.0)
        return {
            "h2d_bytes": d.get(FM + "recall_bytes_total", 0.0) / tokens,
            "prefetch_bytes": 0.0,
            "hit_rate": nan,
            "transfer_ops": pages / tokens,
            "moved_entries": pages * PAGE_ENTRIES * shape.n_c4 / tokens,
            "scored_entries": shape.n_c4 * resident + level1 + monitor,
        }
    raise ValueError(f"unknown arm {arm!r}; expected one of {', '.join(ARMS)}")


def steady_failures(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per (round, context, arm) whose steady window (all requests decoding) did not open: its
    steady_window_s is 0 or its steady_tok_s is not a positive number. [] when every window opened."""
    bad = []
    for r in rounds:
        s, w = r.get("steady_tok_s", float("nan")), r.get("steady_window_s", 0.0)
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0 and w > 0):
            bad.append(
                f"round {r.get('round')}, context {r.get('ctx')}, arm {r.get('arm')}: the window with all "
                f"requests decoding did not open (window {w:.2f} s)"
            )
    return bad


def tokens_equal(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(equal, compared) token positions of each request's output against the reference's, over the common
    prefix length (streams stop at different lengths)."""
    eq = cmp = 0
    for a, b in zip(ref, got):
        m = min(len(a), len(b))
        cmp += m
        eq += sum(1 for i in range(m) if a[i] == b[i])
    return eq, cmp


_DECODE_LINE = re.compile(r"Decode batch[^\n]*?#running-req: (\d+)[^\n]*?gen throughput \(token/s\): ([0-9.]+)")


def decode_step_ms(log_text: str, running: int) -> list[float]:
    """sglang's own per-step decode time from D's log: each 'Decode batch' line with `running` requests running
    reports gen throughput over the last log interval; a step takes running / throughput seconds."""
    out = []
    for m in _DECODE_LINE.finditer(log_text):
        r, tput = int(m.group(1)), float(m.group(2))
        if r == running and tput > 0:
            out.append(1e3 * r / tput)
    return out


def spread(xs: Sequence[float]) -> dict[str, float]:
    """median, min, max of the finite values (NaN when there are none), and how many there were."""
    v = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
