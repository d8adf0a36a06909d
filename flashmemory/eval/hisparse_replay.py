"""Replay of sglang 0.5.23's HiSparse hot buffer (DeepSeek-V4) on recorded top-k picks: its cost at any size.

HiSparse's output equals full attention's by construction; what its buffer size changes is how many of the
indexer's picks must be copied host -> device on the step's critical path. This module counts that, and what a
prefetch hint would save, without KV bytes: one `HotBufferReplay` is the state of one c4 layer of one request.

State (per c4 layer and request, docs/hisparse.md section 3, `ops/hisparse.py`): `slots` LRU slots, each holding
a compressed position or -1 (empty), plus the reserved slot `slots` for the newest entry (position L-1), which is
never in the LRU row. The LRU row is a permutation of 0..slots-1, oldest first.
- Admission: a request that arrives over PD with more than `slots` compressed entries starts with every slot
  empty (-1); any other request starts with slot s holding position s. The LRU row starts as 0..slots-1.
- One step at compressed length L with picks t_0..t_{k-1} (unique positions in [0, L), -1 = none):
  fast path L <= slots: every pick is resident, nothing is counted or moved (sglang's kernel counts no lookup);
  otherwise a pick of L-1 is a hit in the reserved slot, a pick held by an LRU slot is a hit, and the misses, in
  pick order, take the non-hit slots oldest first (empty ones included); the new LRU row is
  [non-hit slots not taken (old order), slots just loaded (pick order), hit slots (old order)].
  Each miss moves one 584-B c4 entry host -> device, synchronously (the attention of that layer waits for it).
- A prefetch of positions runs the same operation after the step's own swap-in (where a Level-1 hint can enter
  without a sglang fork: the same swap-in op on a side stream, right after each layer's own): listed positions
  already resident move to the MRU end, the others take the oldest non-listed slots. After a step with k
  resident picks, a list of at most slots - k positions never evicts one of them. Positions >= L-1 (not yet
  backed up to the host) and duplicates are dropped before the call; nothing is prefetched on the fast path.

Prefetch accounting: a slot loaded by a prefetch is marked until a step pick hits it (a prefetch hit) or it is
evicted first (a wasted prefetch); still marked at the end of a replay: `prefetch_unused_end`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Literal

import torch

ITEM_BYTES = 584  # one DeepSeek-V4 c4 entry: 576 value bytes + 8 scale bytes (ops/hisparse.py ITEM_BYTES)
Admission = Literal["pd", "local"]


@dataclass(frozen=True)
class ReplayStats:
    """Counts summed over c4 layers (and requests). Per layer and step: `calls` (every step, like the live
    `flashmemory_hisparse_swapin_calls_total`), `fast_path_calls` (L <= slots: nothing counted), `lookups` (picks
    >= 0 on the slow path), `hits` (reserved newest slot included), `misses` (= entries copied on demand),
    `demand_transfer_ops` (steps with at least one miss). Prefetch: `prefetched` (entries loaded by hints),
    `prefetch_calls`, `prefetch_transfer_ops`, `prefetch_hits`, `prefetch_wasted`, `prefetch_unused_end`."""

    calls: int = 0
    fast_path_calls: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    demand_transfer_ops: int = 0
    prefetch_calls: int = 0
    prefetched: int = 0
    prefetch_transfer_ops: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    prefetch_unused_end: int = 0

    def __add__(self, other: "ReplayStats") -> "ReplayStats":
        return ReplayStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def hit_rate(self) -> float:
        """hits / lookups (the live counters' ratio); 1.0 when nothing was looked up (all fast path)."""
        return self.hits / self.lookups if self.lookups else 1.0

    @property
    def on_demand_bytes(self) -> int:
        """Host -> device bytes on the step's critical path: misses x 584."""
        return self.misses * ITEM_BYTES

    @property
    def prefetched_bytes(self) -> int:
        """Host -> device bytes moved by prefetches (off the critical path): prefetched x 584."""
        return self.prefetched * ITEM_BYTES

    def as_dict(self) -> dict[str, float]:
        """Every count plus hit_rate, on_demand_bytes and prefetched_bytes (JSON-ready)."""
        return {
            **asdict(self),
            "hit_rate": self.hit_rate,
            "on_demand_bytes": self.on_demand_bytes,
            "prefetched_bytes": self.prefetched_bytes,
        }


class HotBufferReplay:
    """The hot buffer of one c4 layer of one request (see the module docstring for the rules).

    slots: H = sglang's device_buffer_size (>= the step's pick count); start_empty: True for a request admitted
    over PD with more than H compressed entries (every slot -1), False for slot s holding position s. Each
    operation costs O(k log k) for k listed positions, independent of H.
    """

    def __init__(self, slots: int, start_empty: bool = False) -> None:
        if slots < 1:
            raise ValueError(f"HotBufferReplay: slots must be >= 1, got {slots}")
        self.slots = slots
        self.tokens: list[int] = [-1] * slots if start_empty else list(range(slots))
        self.where: dict[int, int] = {} if start_empty else {s: s for s in range(slots)}  # position -> slot
        self.order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(slots))  # oldest first
        self.stamp: list[int] = list(range(slots))  # LRU rank of each slot (larger = more recent)
        self.next_stamp = slots
        self.marked: set[int] = set()  # slots loaded by a prefetch and not picked since
        self.c = dict.fromkeys((f.name for f in fields(ReplayStats)), 0)

    def _pending(self, picks: Sequence[int], length: int, what: str) -> list[int]:
        bad = [p for p in picks if p >= length or p < -1]
        if bad:
            raise ValueError(f"{what}: positions {bad[:4]} outside [-1, {length}) at compressed length {length}")
        pending = [p for p in picks if p >= 0 and p != length - 1]
        if len(set(pending)) != len(pending):
            raise ValueError(f"{what}: duplicate positions (the indexer's top-k has none; sglang's kernel races)")
        return pending

    def _apply(self, pending: list[int]) -> tuple[list[int], list[int]]:
        """The swap-in on `pending` (unique positions, in order): returns (hit slots in old order, loaded slots
        in pick order) after updating tokens, the LRU order and the prefetch marks' eviction count."""
        hit = sorted((self.where[p] for p in pending if p in self.where), key=self.stamp.__getitem__)
        hit_set = set(hit)
        miss = [p for p in pending if p not in self.where]
        take: list[int] = []
        if miss:
            for s in self.order:
                if s not in hit_set:
                    take.append(s)
                    if len(take) == len(miss):
                        break
            if len(take) < len(miss):
                raise ValueError(
                    f"hot buffer of {self.slots} slots cannot take {len(miss)} misses next to {len(hit)} hits"
                )
        for s, p in zip(take, miss):
            old = self.tokens[s]
            if old >= 0:
                del self.where[old]
            if s in self.marked:
                self.marked.discard(s)
                self.c["prefetch_wasted"] += 1
            self.tokens[s], self.where[p] = p, s
        for s in take + hit:
            self.order.move_to_end(s)
            self.stamp[s] = self.next_stamp
            self.next_stamp += 1
        return hit, take

    def step(self, picks: torch.Tensor | Sequence[int], length: int) -> tuple[int, int]:
        """One decode step's swap-in at compressed length `length`. picks: int [k] compressed positions (-1 =
        none), unique, < length. Returns (hits, misses) as sglang's swap-in would count them: (0, 0) on the
        fast path."""
        p = picks.tolist() if isinstance(picks, torch.Tensor) else list(picks)
        self.c["calls"] += 1
        if length <= self.slots:
            self.c["fast_path_calls"] += 1
            return 0, 0
        pending = self._pending(p, length, "step")
        newest = sum(1 for x in p if x == length - 1)
        hit, take = self._apply(pending)
        for s in hit:
            if s in self.marked:
                self.marked.discard(s)
                self.c["prefetch_hits"] += 1
        hits, misses = newest + len(hit), len(take)
        self.c["lookups"] += sum(1 for x in p if x >= 0)
        self.c["hits"] += hits
        self.c["misses"] += misses
        self.c["demand_transfer_ops"] += int(misses > 0)
        return hits, misses

    def prefetch(self, positions: torch.Tensor | Sequence[int], length: int) -> int:
        """Load hinted positions after this step's swap-in (same operation, positions treated as picks).
        positions: int [n]; those < 0 or >= length-1 and repeats are dropped first. At most slots - k positions
        keep the step's k picks resident. Returns the number of entries loaded (584 B each)."""
        p = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
        if length <= self.slots:
            return 0
        pending = list(dict.fromkeys(x for x in p if 0 <= x < length - 1))
        self.c["prefetch_calls"] += 1
        _, take = self._apply(pending)
        self.marked.update(take)
        self.c["prefetched"] += len(take)
        self.c["prefetch_transfer_ops"] += int(bool(take))
        return len(take)

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int32 [slots]: the position each LRU slot holds, -1 empty; lru int16 [slots]: slots oldest
        first), in the layout of sglang's `req_device_buffer_tokens[l, rid, :slots]` and `lru_slots[l, rid]`."""
        return (torch.tensor(self.tokens, dtype=torch.int32), torch.tensor(list(self.order), dtype=torch.int16))

    def stats(self) -> ReplayStats:
        """The counts so far; prefetched slots not yet picked nor evicted count as `prefetch_unused_end`."""
        return ReplayStats(**{**self.c, "prefetch_unused_end": len(self.marked)})


def replay_hisparse(
    picks: Sequence[Sequence[torch.Tensor]],
    lengths: Sequence[int],
    slots: int,
    hint: Mapping[int, torch.Tensor] | None = None,
    admission: Admission = "pd",
    cap_hint: bool = True,
) -> ReplayStats:
    """One request's decode replayed through a hot buffer of `slots` per c4 layer, summed over the layers.

    picks: layer -> step -> int [k] top-k compressed positions of that layer's indexer at that step (-1 = none);
    lengths: compressed length L per step (the history the step's indexer scored, its newest entry L-1);
    hint: step -> int [n] positions prefetched at every c4 layer right after that step's swap-in (a Level-1
    prediction for the steps to come); cap_hint: keep only the first slots - k of them (k = that step's pick
    count), the bound under which a prefetch never evicts a current pick. admission: "pd" = sglang's decode
    server (a request longer than `slots` at its first step starts empty), "local" = slot s holds position s.
    """
    if admission not in ("pd", "local"):
        raise ValueError(f"admission must be 'pd' or 'local', got {admission!r}")
    if not lengths:
        return ReplayStats()
    start_empty = admission == "pd" and lengths[0] > slots
    total = ReplayStats()
    for li, layer in enumerate(picks):
        if len(layer) != len(lengths):
            raise ValueError(f"layer {li}: {len(layer)} steps of picks vs {len(lengths)} lengths")
        buf = HotBufferReplay(slots, start_empty)
        for t, (pk, length) in enumerate(zip(layer, lengths)):
            buf.step(pk, int(length))
            if hint is not None and t in hint:
                h = hint[t]
                if cap_hint:
                    h = h[: max(0, slots - int(pk.numel()))]
                buf.prefetch(h, int(length))
        total = total + buf.stats()
    return total
