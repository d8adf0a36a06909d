"""A live HiSparse trace replayed (flashmemory/eval/hisparse_trace.py): the CPU swap-in hook's own trace
(FLASHMEMORY_HISPARSE_TRACE) replays to its counts call by call; admission, --oracle, the CLI and refusals."""

from __future__ import annotations

import random

import pytest
import torch

from tests.eval.test_hisparse_replay import _op_state, _topk_walk


def test_trace_of_the_patched_swap_in_replays_exactly(tmp_path, monkeypatch) -> None:
    """The CPU server's swap-in hook (patches_hisparse.swap_in_dsv4, gate on) writes a trace of two c4 layers and
    two requests, one admitted empty over PD and one at 0..H-1, a request slot reused after a new admission; the
    replay of the trace gives the hook's own counts call by call, and the totals its counter kept."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from flashmemory.sglang.cpu import patches_hisparse as hp
    from flashmemory.sglang.cpu.hisparse_record import SwapInCounter

    trace = tmp_path / "trace.jsonl"
    counter = SwapInCounter()
    counter.prom = {}
    monkeypatch.setattr(hp, "hisparse_on_cpu", lambda: True)
    from flashmemory.sglang.decode.context import HiSparseState
    from flashmemory.sglang.decode.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "hisparse", HiSparseState(swapin=counter, trace_path=str(trace)))
    hot, k, max_len, rnd = 8, 6, 40, random.Random(7)
    layers = [_op_state(2, hot, max_len, empty=False) for _ in range(2)]
    coord = SimpleNamespace(
        is_dsv4_hisparse=True,
        device_buffer_size=hot,
        host_token_len=lambda n: n // 4,
        mem_pool_device=SimpleNamespace(kv_buffer=[]),
    )

    def admit(rid: int, compressed: int) -> None:
        hp.admit_direct(
            None, coord, SimpleNamespace(kv=SimpleNamespace(req_pool_idx=rid, kv_allocated_len=4 * compressed))
        )
        for s in layers:  # what sglang does at admission: 0..H-1, or empty for a long PD request
            s["tokens"][rid, :hot] = -1 if compressed > hot else torch.arange(hot, dtype=torch.int32)
            s["lru"][rid] = torch.arange(hot, dtype=torch.int16)

    admit(0, 20)
    admit(1, 6)
    lens, prev = [20, 6], [[], []]
    for step in range(40):
        if step == 20:
            admit(0, 30)  # slot 0 finished and was given to a new long request
            lens[0], prev[0] = 30, []
        lens = [min(max_len, n + (rnd.random() < 0.5)) for n in lens]
        rows = [_topk_walk(rnd, prev[r], lens[r], k, keep=0.7) for r in range(2)]
        prev = rows
        for s in layers:
            out = torch.full((2, k), -1, dtype=torch.int32)
            hp.swap_in_dsv4(
                None,
                torch.tensor(rows, dtype=torch.int32),
                s["tokens"],
                s["host_locs"],
                s["locs"],
                s["host"],
                s["device"],
                out,
                torch.arange(2),
                torch.tensor(lens),
                s["lru"],
                584,
                k,
                hot,
            )
    from flashmemory.eval.hisparse_trace import replay_trace

    got = replay_trace(str(trace))
    live = counter.snapshot()
    assert got.mismatched_calls == 0 and (got.layers, got.requests, got.recorded_hot) == (2, 2, hot)
    assert got.recorded["calls"] == live["calls"] == 80
    assert (got.replayed.lookups, got.replayed.hits, got.replayed.misses) == (
        live["lookups"],
        live["hits"],
        live["misses"],
    ) and live["misses"] > 0
    bigger = replay_trace(str(trace), slots=2 * hot)
    assert bigger.slots == 2 * hot and bigger.replayed.misses < got.replayed.misses


def test_trace_is_off_by_default_and_a_relative_path_is_refused(tmp_path) -> None:
    from flashmemory.env import EnvError, hisparse_trace

    assert hisparse_trace({}) == ""
    assert hisparse_trace({"FLASHMEMORY_HISPARSE_TRACE": str(tmp_path / "t")}) == str(tmp_path / "t")
    with pytest.raises(EnvError, match="FLASHMEMORY_HISPARSE_TRACE"):
        hisparse_trace({"FLASHMEMORY_HISPARSE_TRACE": "t.jsonl"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    from flashmemory.eval.hisparse_trace import replay_trace

    with pytest.raises(ValueError, match="bad.jsonl:1"):
        replay_trace(str(bad))


def test_main_prints_one_line_per_buffer_size(tmp_path, capsys) -> None:
    import json

    from flashmemory.eval.hisparse_trace import main

    trace = tmp_path / "t.jsonl"
    lines = [
        {"ev": "admit", "rid": 3, "empty": True},
        {
            "ev": "swapin",
            "layer": 0,
            "hot": 4,
            "k": 3,
            "rows": [[3, 10, [9, 0, 1]]],
            "lookups": 3,
            "hits": 1,
            "misses": 2,
        },
        {
            "ev": "swapin",
            "layer": 0,
            "hot": 4,
            "k": 3,
            "rows": [[3, 11, [10, 0, 2]]],
            "lookups": 3,
            "hits": 2,
            "misses": 2,
        },
    ]  # the live op said 2 hits; the replay gives 2 (10, 0)
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main([str(trace), "4", "2"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [o["slots"] for o in out] == [4, 2]
    assert out[0]["recorded"] == {"calls": 2, "lookups": 6, "hits": 3, "misses": 4}
    assert (out[0]["replayed"]["hits"], out[0]["replayed"]["misses"], out[0]["mismatched_calls"]) == (3, 3, 1)
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err
    assert main([str(trace), "zero"]) == 2


def test_trace_admission_follows_the_replayed_size(tmp_path) -> None:
    """A request whose prefill brought 10 c4 entries starts empty under a 4-slot buffer but preloaded (slot s =
    position s) under a 12-slot one, as sglang's admission decides by the buffer size."""
    import json

    from flashmemory.eval.hisparse_trace import replay_trace

    trace = tmp_path / "t.jsonl"
    lines = [
        {"ev": "admit", "rid": 0, "entries": 10, "empty": True},
        {"ev": "swapin", "layer": 0, "hot": 4, "k": 2, "rows": [[0, 13, [0, 1]]], "lookups": 2, "hits": 0, "misses": 2},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert replay_trace(str(trace)).replayed.misses == 2
    assert replay_trace(str(trace), slots=12).replayed.hits == 2


def test_trace_oracle_prefetches_the_next_step_of_the_same_request(tmp_path) -> None:
    """--oracle: after each step, the same layer's next picks of the same request (at most slots - k) are
    prefetched; a new admission of the slot ends the request, so its picks are not hinted across it."""
    import json
    import subprocess
    import sys

    from flashmemory.eval.hisparse_trace import replay_trace

    trace = tmp_path / "t.jsonl"

    def call(picks: list[int]) -> dict:
        return {
            "ev": "swapin",
            "layer": 0,
            "hot": 4,
            "k": 2,
            "rows": [[0, 20, picks]],
            "lookups": 2,
            "hits": 0,
            "misses": 2,
        }

    lines = [
        {"ev": "admit", "rid": 0, "entries": 19, "empty": True},
        call([0, 1]),
        call([2, 3]),
        call([4, 5]),
        {"ev": "admit", "rid": 0, "entries": 19, "empty": True},
        call([6, 7]),
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    plain = replay_trace(str(trace)).replayed
    assert (plain.misses, plain.prefetched) == (8, 0)
    hinted = replay_trace(str(trace), oracle=True).replayed
    assert (hinted.misses, hinted.prefetched, hinted.prefetch_hits) == (4, 4, 4)  # [6, 7] not hinted: new request
    done = subprocess.run(
        [sys.executable, "-m", "flashmemory.eval.hisparse_trace", str(trace), "--oracle"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["replayed"]["prefetch_hits"] == 4


@pytest.mark.parametrize("content", ["", '{"ev": "admit", "rid": 0, "entries": 3, "empty": false}\n'])
def test_a_trace_without_a_swap_in_call_is_an_error_naming_the_file(tmp_path, capsys, content) -> None:
    """An empty trace (or one with admissions only) replayed to hit rate 1.0 over 0 calls and exit 0, which reads
    as a perfect buffer: it is one error line naming the file, exit 2, and nothing on stdout."""
    from flashmemory.eval.hisparse_trace import main, replay_trace

    trace = tmp_path / "empty.jsonl"
    trace.write_text(content)
    with pytest.raises(ValueError, match="empty.jsonl.*nothing to replay"):
        replay_trace(str(trace))
    assert main([str(trace)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and str(trace) in err and "Traceback" not in err
