"""A live HiSparse trace replayed: what the CPU server's swap-in did, call by call, against the hot-buffer replay.

With FLASHMEMORY_HISPARSE_TRACE=/abs/file.jsonl (a diagnostic, off by default) the HiSparse CPU swap-in
(`flashmemory.sglang.cpu.patches_hisparse`) appends JSON lines:
- {"ev": "admit", "rid": request slot, "entries": c4 entries its prefill brought, "empty": started empty};
- {"ev": "swapin", "layer": c4 layer index, "hot": buffer size, "k": picks per row,
  "rows": [[request slot, compressed length, [picks]] ...], "lookups", "hits", "misses"}: one per call (one c4
  layer of one decode batch), with the op's own counts.
`replay_trace` replays them through `hisparse_replay.HotBufferReplay`; at the recorded size the counts must equal
the op's on every call (the same picks, the same rule), at other sizes they give that buffer's cost on the same
live picks. `python -m flashmemory.eval.hisparse_trace TRACE [SLOTS ...] [--oracle]` prints one JSON line per size.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from flashmemory.eval.hisparse_replay import HotBufferReplay, ReplayStats


@dataclass(frozen=True)
class TraceReplay:
    """A live trace replayed: `replayed` (the replay's counts, at `slots`; its `calls` count (layer, request,
    step) triples), `recorded` (the live op's own per-call counts summed: calls = one per layer per batch, lookups,
    hits, misses), `mismatched_calls` (calls whose replayed hits or misses differ from the live op's; meaningful
    when slots == recorded_hot), `layers` and `requests` (request slots) seen."""

    replayed: ReplayStats
    recorded: dict[str, int]
    mismatched_calls: int
    slots: int
    recorded_hot: int
    layers: int
    requests: int


def _read_trace(path: str) -> list[dict]:
    recs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                recs.append(json.loads(line))
                if recs[-1]["ev"] not in ("admit", "swapin"):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: not a HiSparse trace line") from None
    return recs


def _next_picks(recs: list[dict]) -> dict[tuple[int, int], list[int]]:
    """(record index, row index) -> the same (layer, request)'s picks at its next call, within one admission."""
    after: dict[tuple[int, int], list[int]] = {}
    out = {}
    for i in range(len(recs) - 1, -1, -1):
        rec = recs[i]
        if rec["ev"] == "admit":
            for key in [k for k in after if k[1] == int(rec["rid"])]:
                del after[key]
            continue
        for j, (rid, _, picks) in enumerate(rec["rows"]):
            key = (int(rec["layer"]), int(rid))
            if key in after:
                out[(i, j)] = after[key]
            after[key] = picks
    return out


def replay_trace(path: str, slots: int | None = None, oracle: bool = False) -> TraceReplay:
    """Replay a FLASHMEMORY_HISPARSE_TRACE file (JSON lines written by the HiSparse CPU swap-in,
    `flashmemory.sglang.cpu.hisparse_record.trace_swapin`): one hot buffer per (c4 layer, request slot), started
    over at each {"ev": "admit"} of its slot (empty when its prefill brought more c4 entries than the replayed
    size, else 0..H-1; a slot never admitted starts at 0..H-1, sglang's `alloc_device_buffer`). slots: the
    buffer size to replay (default: the recorded one; another size gives that buffer's cost on the same live
    picks). oracle: after each step, prefetch the same layer's picks of the request's next step (at most
    slots - k of them): the bound a perfect one-step hint reaches at that size. Raises ValueError naming the
    file for a line that is not a trace record or a trace with no swap-in call (nothing to replay)."""
    recs = _read_trace(path)
    if not any(rec["ev"] == "swapin" for rec in recs):  # else: hit rate 1.0 over 0 calls, as if all had hit
        what = "is empty" if not recs else f"has {len(recs)} admission line(s) and no swap-in line"
        raise ValueError(f"{path}: the trace {what}: nothing to replay (did the traced server decode?)")
    nxt = _next_picks(recs) if oracle else {}
    bufs: dict[tuple[int, int], HotBufferReplay] = {}
    empty: dict[int, bool] = {}
    finished = ReplayStats()
    recorded = dict.fromkeys(("calls", "lookups", "hits", "misses"), 0)
    mismatched, hot_seen, layers, rids = 0, 0, set(), set()
    for i, rec in enumerate(recs):
        if rec["ev"] == "admit":
            rid = int(rec["rid"])
            for key in [k for k in bufs if k[1] == rid]:
                finished = finished + bufs.pop(key).stats()
            # the admission rule at the replayed size where the entry count is known, else as recorded
            empty[rid] = int(rec["entries"]) > (slots or 0) if slots and "entries" in rec else bool(rec["empty"])
            continue
        hot_seen = int(rec["hot"])
        size = slots or hot_seen
        layer = int(rec["layer"])
        layers.add(layer)
        hits = misses = 0
        for j, (rid, length, picks) in enumerate(rec["rows"]):
            rids.add(rid)
            buf = bufs.get((layer, rid))
            if buf is None:
                buf = bufs[(layer, rid)] = HotBufferReplay(size, empty.get(rid, False))
            h, m = buf.step(picks, int(length))
            hits, misses = hits + h, misses + m
            if (i, j) in nxt and size > len(picks):
                buf.prefetch(nxt[(i, j)][: size - len(picks)], int(length))
        recorded["calls"] += 1
        for k in ("lookups", "hits", "misses"):
            recorded[k] += int(rec[k])
        mismatched += int((hits, misses) != (int(rec["hits"]), int(rec["misses"])))
    total = sum((b.stats() for b in bufs.values()), finished)
    return TraceReplay(total, recorded, mismatched, slots or hot_seen, hot_seen, len(layers), len(rids))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flashmemory.eval.hisparse_trace TRACE [SLOTS ...] [--oracle]`: one JSON line per buffer size
    (default the recorded one): the live op's summed counts, the replay's (with --oracle: each step prefetches the
    next step's picks), and the calls where replay and live op differ."""
    args = list(sys.argv[1:] if argv is None else argv)
    oracle = "--oracle" in args
    args = [a for a in args if a != "--oracle"]
    if not args or not all(a.isdigit() and int(a) > 0 for a in args[1:]):
        print("usage: python -m flashmemory.eval.hisparse_trace TRACE.jsonl [SLOTS ...] [--oracle]", file=sys.stderr)
        return 2
    try:
        for size in [int(a) for a in args[1:]] or [None]:
            r = replay_trace(args[0], size, oracle)
            print(
                json.dumps(
                    {
                        "slots": r.slots,
                        "recorded_hot": r.recorded_hot,
                        "layers": r.layers,
                        "requests": r.requests,
                        "recorded": r.recorded,
                        "mismatched_calls": r.mismatched_calls,
                        "replayed": r.replayed.as_dict(),
                    }
                )
            )
    except (OSError, ValueError) as e:
        print(f"flashmemory eval.hisparse_trace: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
