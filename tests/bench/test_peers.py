"""`flashmemory bench peers`, the pure parts: counters -> per-token costs, device bytes, the steady-window check,
token equality, sglang's decode log, the summary and table, and bad arguments (one line, exit 2)."""

from __future__ import annotations

import argparse
import json

import pytest

from flashmemory.bench import peers, peers_report
from flashmemory.bench.peers_costs import (HS, Knobs, PeersArgError, Shape, decode_step_ms, delta, device_bytes,
                                           parse_contexts, per_token_costs, shape_from_config, steady_failures,
                                           tokens_equal)
from flashmemory.serve.client import parse_metrics

SHAPE = Shape(n_c4=2, index_topk=512, index_entry_bytes=132)
KNOBS = Knobs(kmax=2, interval=16, retriever_layers=2, hot_buffer=512)

METRICS_BEFORE = """# HELP flashmemory_hisparse_swapin_calls_total x
flashmemory_hisparse_swapin_calls_total 4.0
flashmemory_hisparse_swapin_misses_total 1000.0
flashmemory_hisparse_swapin_bytes_h2d_total 584000.0
flashmemory_resident_fraction 0.5
"""
METRICS_AFTER = """flashmemory_hisparse_swapin_calls_total 36.0
flashmemory_hisparse_swapin_misses_total{tp_rank="0"} 3000.0
flashmemory_hisparse_swapin_bytes_h2d_total 1752000.0
flashmemory_resident_fraction 0.25
"""


def test_hisparse_costs_from_metrics_text():
    d = delta(parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER))
    assert d == {HS + "calls_total": 32.0, HS + "misses_total": 2000.0, HS + "bytes_h2d_total": 1168000.0}
    c = per_token_costs("hisparse", d, tokens=16, ctx=4000, shape=SHAPE, knobs=KNOBS)
    assert c["h2d_bytes"] == 1168000 / 16 and c["moved_entries"] == 125.0 and c["transfer_ops"] == 2.0
    assert c["scored_entries"] == 2 * 1000      # the native indexer: the whole history at both c4 layers


def test_stock_and_flashmemory_costs():
    s = per_token_costs("stock", {}, 10, 4000, SHAPE, KNOBS)
    assert s == {"h2d_bytes": 0.0, "transfer_ops": 0.0, "moved_entries": 0.0, "scored_entries": 2000.0}
    d = {"flashmemory_recall_bytes_total": 2 * 64 * 2 * 584.0, "flashmemory_recall_pages_total": 2.0,
         "flashmemory_level1_cycles_total": 4.0, "flashmemory_monitor_cycles_total": 2.0}
    f = per_token_costs("fm_monitor", d, 32, 4000, SHAPE, KNOBS, resident_fraction=0.1)
    assert f["h2d_bytes"] == pytest.approx(2 * 64 * 2 * 584 / 32)
    assert f["transfer_ops"] == pytest.approx(2 / 32) and f["moved_entries"] == pytest.approx(2 * 64 * 2 / 32)
    # resident 100 of 1000 entries at 2 layers + Level 1: 4 cycles x 2 layers x 1000 / 32 + monitor 2 x 1000 / 32
    assert f["scored_entries"] == pytest.approx(200 + 250 + 62.5)
    # without a measured fraction: KMAX pages of 64 entries
    assert per_token_costs("flashmemory", {}, 32, 4000, SHAPE, KNOBS)["scored_entries"] == 2 * 128
    with pytest.raises(ValueError, match="tokens=0"):
        per_token_costs("stock", {}, 0, 4000, SHAPE, KNOBS)
    with pytest.raises(ValueError, match="unknown arm"):
        per_token_costs("other", {}, 1, 4000, SHAPE, KNOBS)


def test_device_bytes_split():
    assert device_bytes("stock", 4000, SHAPE, KNOBS) == {"c4_kv": 2 * 1000 * 584.0, "index_k": 2 * 1000 * 132.0,
                                                         "reserve": 0.0}
    assert device_bytes("hisparse", 4000, SHAPE, KNOBS)["reserve"] == 2 * 576 * 584
    assert device_bytes("flashmemory", 4000, SHAPE, KNOBS)["reserve"] == 2 * 128 * 584
    assert device_bytes("fm_monitor", 4000, SHAPE, KNOBS, budget_pages=3.0)["reserve"] == 2 * 192 * 584
    assert device_bytes("flashmemory", 256, SHAPE, KNOBS)["reserve"] == 2 * 64 * 584   # capped by the history


def test_shape_from_config():
    s = shape_from_config({"compress_ratios": [0, 4, 128, 4, 128, 0], "index_topk": 512, "index_head_dim": 128})
    assert s == SHAPE
    with pytest.raises(PeersArgError, match="index_topk"):
        shape_from_config({"compress_ratios": [4]})


def _rec(arm, rnd, steady, window, **kw):
    base = {"arm": arm, "ctx": 4000, "round": rnd, "steady_tok_s": steady, "steady_window_s": window,
            "itl_ms": 100.0, "step_ms": [50.0], "eq": 8, "cmp": 8,
            "costs": {"h2d_bytes": 0.0, "transfer_ops": 0.0, "moved_entries": 0.0, "scored_entries": 2000.0},
            "device": {"c4_kv": 1.0, "index_k": 2.0, "reserve": 3.0}}
    base.update(kw)
    return base


def test_steady_window_check_fails_when_a_window_does_not_open():
    ok = [_rec("stock", 0, 10.0, 2.0), _rec("hisparse", 0, 8.0, 1.5)]
    assert steady_failures(ok) == []
    bad = ok + [_rec("flashmemory", 0, float("nan"), 0.0)]
    lines = steady_failures(bad)
    assert len(lines) == 1 and "arm flashmemory" in lines[0] and "did not open" in lines[0]
    assert steady_failures([_rec("stock", 1, 0.0, 3.0)])      # no tokens in an open window is a failure too


def test_tokens_equal_common_prefix():
    assert tokens_equal([[1, 2, 3], [4, 5]], [[1, 2, 9, 7], [4]]) == (3, 4)
    # Positions after a mismatch still count: equal tokens are counted position by position, not up to the first
    # difference (one sampled token that differs must not write off the rest of the stream).
    assert tokens_equal([[1, 2, 3, 4, 5]], [[1, 9, 3, 4, 5, 6]]) == (4, 5)
    assert tokens_equal([[7, 8], [1, 2, 3]], [[0, 8], [1, 0, 3]]) == (3, 5)
    assert tokens_equal([[1, 2]], [[]]) == (0, 0)


def test_decode_step_ms_reads_only_full_batches():
    log = ("[x] Decode batch, #running-req: 2, #token: 100, gen throughput (token/s): 20.00, #queue-req: 0\n"
           "[x] Decode batch, #running-req: 1, #token: 50, gen throughput (token/s): 40.00, #queue-req: 0\n")
    assert decode_step_ms(log, 2) == [100.0]
    assert decode_step_ms(log, 3) == []


def test_summary_and_table():
    rounds = [_rec("stock", 0, 10.0, 2.0), _rec("stock", 1, 12.0, 2.0),
              _rec("hisparse", 0, 8.0, 2.0, eq=7, cmp=8,
                   costs={"h2d_bytes": 5000.0, "transfer_ops": 1.0, "moved_entries": 9.0, "scored_entries": 2000.0}),
              _rec("hisparse", 1, 6.0, 2.0)]
    rows = peers_report.summarize(rounds)
    assert [r["arm"] for r in rows] == ["stock", "hisparse"]
    hs = rows[1]
    assert hs["tokens_equal"] == 15 / 16 and hs["tokens_compared"] == 16
    assert hs["vs_stock"]["min"] == pytest.approx(0.5) and hs["vs_stock"]["max"] == pytest.approx(0.8)
    assert hs["costs"]["h2d_bytes"] == 2500.0       # median of 5000 and 0
    md = peers_report.markdown(rows)
    assert md.splitlines()[0].startswith("| context | arm |") and len(md.splitlines()) == 4
    assert "| HiSparse | 2.5 |" in md and "0.938 of 16" in md and "0.65 (0.50-0.80)" in md
    assert "HiSparse" in peers_report.plain(rows)


def test_report_main_reads_json(tmp_path, capsys):
    p = tmp_path / "peers.json"
    p.write_text(json.dumps({"summary": peers_report.summarize([_rec("stock", 0, 10.0, 2.0)])}))
    assert peers_report.main([str(p)]) == 0
    assert "| 4,000 | stock |" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert peers_report.main([str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a peers JSON" in err


@pytest.mark.parametrize("text", ["", "a,b", "4096,2048", "2048,2048", "32"])
def test_bad_contexts(text):
    with pytest.raises(PeersArgError, match="--contexts"):
        parse_contexts(text)
    assert parse_contexts("2304, 4096") == [2304, 4096]


@pytest.mark.parametrize("argv,flag", [(["--contexts", "9,x"], "--contexts"), (["--requests", "0"], "--requests"),
                                       (["--repeats", "0"], "--repeats"), (["--kmax", "0"], "--kmax"),
                                       (["--hisparse-buffer", "100"], "--hisparse-buffer"),
                                       (["--steady-tokens", "1"], "--steady-tokens")])
def test_run_bad_args_one_line_exit_2(argv, flag, capsys):
    p = argparse.ArgumentParser()
    peers.add_args(p)
    assert peers.run(p.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flashmemory bench peers: error: {flag}")


def test_run_tokens_below_steady_one_line_exit_2(capsys):
    p = argparse.ArgumentParser()
    peers.add_args(p)
    assert peers.run(p.parse_args(["--tokens", "8", "--steady-tokens", "8"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flashmemory bench peers: error: --tokens 8")


def test_curve_diverges_with_history():
    md = peers_report.curve_markdown(SHAPE, KNOBS, [4096, 16384]).splitlines()
    assert len(md) == 2 + 2 * 3
    # stock and HiSparse score the whole history (2 x 1024, then 2 x 4096); FlashMemory 2 x 128 + Level 1 (2 x n / 16)
    assert md[2].endswith("| 2048 |") and md[3].endswith("| 2048 |") and md[4].endswith("| 384 |")
    assert md[5].endswith("| 8192 |") and md[7].endswith("| 768 |")
    # HiSparse's hot buffer stays 2 x 576 x 584 B whatever the history; stock's c4 KV grows with it
    assert "+ 673) |" in md[3] and "+ 673) |" in md[6] and "| 4,096 | stock | 1466 (1196 + 270 + 0) |" in md[2]


def test_the_pool_admits_every_request_into_ds_swa_pool():
    """D admits a PD request only when max_new + its SWA tail fits the SWA pool (swa ratio 0.1 of the pool for
    DSv4); the first live run with --tokens 2048 got a 10,240-token pool, a 1,024-token SWA pool, and hung."""
    from flashmemory.bench.peers_costs import SWA_RATIO, SWA_SLACK, pool_tokens
    for ctx, max_new, n in [(2304, 2048, 2), (2304, 512, 2), (9216, 160, 2), (4608, 512, 4)]:
        pool = pool_tokens(ctx, max_new, n)
        assert pool >= n * (ctx + max_new)                             # the full pool holds every request
        assert int(pool * SWA_RATIO) >= n * (max_new + SWA_SLACK)      # and D's SWA pool admits them all
    assert pool_tokens(2304, 2048, 2) > 10240
