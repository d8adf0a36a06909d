"""An independent plain-Python model of sglang's DeepSeek-V4 HiSparse hot buffer, to check the torch ops against.

No torch: lists, dicts and bytearrays. It keeps the hot buffer as an ordered list of slot ids (least recently
used first) and a slot -> token table, and applies the rule stated in docs/hisparse.md step by step, one pick
at a time, the way one would on paper:
  1. the newest compressed entry always sits in the reserved slot `hot`;
  2. a pick already held by some LRU slot is a hit;
  3. every other pick (in pick order) evicts the least recently used slot that was not hit this step;
  4. the new order is: untouched slots (old order), then the slots just filled (pick order), then the hits
     (old order).
Cache bytes are modelled as one bytearray per cache with the page-row offsets computed from the layout constants
(`VALUE`, `SCALE`, `PAGE`), written out here again rather than imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAGE_TOKENS = 64
VALUE = 576
SCALE = 8
PAGE = 65 * 576  # ceil(64 * 584 / 576) = 65 rows of 576 B


def token_spans(loc: int) -> list[tuple[int, int]]:
    """The two byte ranges [start, end) that hold token `loc` in a page-padded c4 cache."""
    page, slot = divmod(loc, PAGE_TOKENS)
    v = page * PAGE + slot * VALUE
    s = page * PAGE + PAGE_TOKENS * VALUE + slot * SCALE
    return [(v, v + VALUE), (s, s + SCALE)]


def copy_token(src: bytearray, dst: bytearray, src_loc: int, dst_loc: int) -> None:
    for (a, b), (c, d) in zip(token_spans(src_loc), token_spans(dst_loc)):
        dst[c:d] = src[a:b]


@dataclass
class RefHotBuffer:
    """One request at one layer. slot_token[s]: position held by slot s (-1 empty); lru: slots, oldest first;
    slot_loc[s]: device loc of slot s (slot `hot` is the reserved newest slot)."""

    hot: int
    slot_loc: list[int]
    slot_token: list[int]
    lru: list[int] = field(default_factory=list)
    hits: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        if not self.lru:
            self.lru = list(range(self.hot))

    def step(
        self,
        picks: list[int],
        seq_len: int,
        host_loc: list[int],
        host: bytearray,
        device: bytearray,
        prev_out: list[int],
    ) -> list[int]:
        """Resolve `picks` (compressed positions, -1 = none) at compressed length `seq_len`; returns the device
        loc per pick. prev_out: what the output row held before (an entry the kernel leaves alone keeps it)."""
        k = len(picks)
        if seq_len <= self.hot:
            n = min(seq_len, k)
            return [self.slot_loc[p] if i < n and p >= 0 else -1 for i, p in enumerate(picks)]
        out = list(prev_out)
        held_by = {}
        for s in self.lru:
            if self.slot_token[s] >= 0:
                held_by.setdefault(self.slot_token[s], []).append(s)
        hit_slots: set[int] = set()
        missed: list[int] = []  # pick indices, in pick order
        claimed: set[int] = set()
        for i, p in enumerate(picks):
            if p == -1:
                continue  # the kernel reads -1 as TOKEN_HIT: output left as it was
            if p == seq_len - 1:
                out[i] = self.slot_loc[self.hot]
                self.hits += 1
                continue
            if p in held_by and p not in claimed:
                claimed.add(p)
                for s in held_by[p]:
                    hit_slots.add(s)
                    out[i] = self.slot_loc[s]
                self.hits += 1
            else:
                missed.append(i)
        victims = [s for s in self.lru if s not in hit_slots]
        assert len(missed) <= len(victims), "more misses than free slots"
        filled = []
        for i, s in zip(missed, victims):
            self.slot_token[s] = picks[i]
            out[i] = self.slot_loc[s]
            copy_token(host, device, host_loc[picks[i]], self.slot_loc[s])
            filled.append(s)
            self.misses += 1
        untouched = victims[len(missed) :]
        hits_in_order = [s for s in self.lru if s in hit_slots]
        self.lru = untouched + filled + hits_in_order
        return out
