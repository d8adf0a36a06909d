"""`flashmemory bench peers`, the pure parts: counters -> per-token costs (HiSparse+prefetch's on-demand and
prefetched bytes and hit rate too), device bytes, arm keys per hot-buffer size, the stacks' settings, the
steady-window check, token equality, sglang's decode log, the summary and table, and bad arguments (one line,
exit 2)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from flashmemory.bench import peers, peers_report
from flashmemory.bench.peers_costs import (
    HP,
    HS,
    Knobs,
    PeersArgError,
    Shape,
    arm_key,
    arm_label,
    arm_order,
    decode_step_ms,
    delta,
    device_bytes,
    parse_arms,
    parse_buffers,
    parse_contexts,
    per_token_costs,
    shape_from_config,
    split_arm,
    steady_failures,
    tokens_equal,
)
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
    assert c["scored_entries"] == 2 * 1000  # the native indexer: the whole history at both c4 layers


def test_stock_and_flashmemory_costs():
    s = per_token_costs("stock", {}, 10, 4000, SHAPE, KNOBS)
    assert math.isnan(s.pop("hit_rate"))  # no hot buffer
    assert s == {
        "h2d_bytes": 0.0,
        "prefetch_bytes": 0.0,
        "transfer_ops": 0.0,
        "moved_entries": 0.0,
        "scored_entries": 2000.0,
    }
    d = {
        "flashmemory_recall_bytes_total": 2 * 64 * 2 * 584.0,
        "flashmemory_recall_pages_total": 2.0,
        "flashmemory_level1_cycles_total": 4.0,
        "flashmemory_monitor_cycles_total": 2.0,
    }
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
    assert device_bytes("stock", 4000, SHAPE, KNOBS) == {
        "c4_kv": 2 * 1000 * 584.0,
        "index_k": 2 * 1000 * 132.0,
        "reserve": 0.0,
    }
    assert device_bytes("hisparse", 4000, SHAPE, KNOBS)["reserve"] == 2 * 576 * 584
    assert device_bytes("flashmemory", 4000, SHAPE, KNOBS)["reserve"] == 2 * 128 * 584
    assert device_bytes("fm_monitor", 4000, SHAPE, KNOBS, budget_pages=3.0)["reserve"] == 2 * 192 * 584
    assert device_bytes("flashmemory", 256, SHAPE, KNOBS)["reserve"] == 2 * 64 * 584  # capped by the history


def test_shape_from_config():
    s = shape_from_config({"compress_ratios": [0, 4, 128, 4, 128, 0], "index_topk": 512, "index_head_dim": 128})
    assert s == SHAPE
    with pytest.raises(PeersArgError, match="index_topk"):
        shape_from_config({"compress_ratios": [4]})


def _rec(arm, rnd, steady, window, **kw):
    base = {
        "arm": arm,
        "ctx": 4000,
        "round": rnd,
        "steady_tok_s": steady,
        "steady_window_s": window,
        "itl_ms": 100.0,
        "step_ms": [50.0],
        "eq": 8,
        "cmp": 8,
        "costs": {"h2d_bytes": 0.0, "transfer_ops": 0.0, "moved_entries": 0.0, "scored_entries": 2000.0},
        "device": {"c4_kv": 1.0, "index_k": 2.0, "reserve": 3.0},
    }
    base.update(kw)
    return base


def test_steady_window_check_fails_when_a_window_does_not_open():
    ok = [_rec("stock", 0, 10.0, 2.0), _rec("hisparse", 0, 8.0, 1.5)]
    assert steady_failures(ok) == []
    bad = ok + [_rec("flashmemory", 0, float("nan"), 0.0)]
    lines = steady_failures(bad)
    assert len(lines) == 1 and "arm flashmemory" in lines[0] and "did not open" in lines[0]
    assert steady_failures([_rec("stock", 1, 0.0, 3.0)])  # no tokens in an open window is a failure too


def test_tokens_equal_common_prefix():
    assert tokens_equal([[1, 2, 3], [4, 5]], [[1, 2, 9, 7], [4]]) == (3, 4)
    # Positions after a mismatch still count: equal tokens are counted position by position, not up to the first
    # difference (one sampled token that differs must not write off the rest of the stream).
    assert tokens_equal([[1, 2, 3, 4, 5]], [[1, 9, 3, 4, 5, 6]]) == (4, 5)
    assert tokens_equal([[7, 8], [1, 2, 3]], [[0, 8], [1, 0, 3]]) == (3, 5)
    assert tokens_equal([[1, 2]], [[]]) == (0, 0)


def test_decode_step_ms_reads_only_full_batches():
    log = (
        "[x] Decode batch, #running-req: 2, #token: 100, gen throughput (token/s): 20.00, #queue-req: 0\n"
        "[x] Decode batch, #running-req: 1, #token: 50, gen throughput (token/s): 40.00, #queue-req: 0\n"
    )
    assert decode_step_ms(log, 2) == [100.0]
    assert decode_step_ms(log, 3) == []


def test_summary_and_table():
    rounds = [
        _rec("stock", 0, 10.0, 2.0),
        _rec("stock", 1, 12.0, 2.0),
        _rec(
            "hisparse",
            0,
            8.0,
            2.0,
            eq=7,
            cmp=8,
            costs={"h2d_bytes": 5000.0, "transfer_ops": 1.0, "moved_entries": 9.0, "scored_entries": 2000.0},
        ),
        _rec("hisparse", 1, 6.0, 2.0),
    ]
    rows = peers_report.summarize(rounds)
    assert [r["arm"] for r in rows] == ["stock", "hisparse"]
    hs = rows[1]
    assert hs["tokens_equal"] == 15 / 16 and hs["tokens_compared"] == 16
    assert hs["vs_stock"]["min"] == pytest.approx(0.5) and hs["vs_stock"]["max"] == pytest.approx(0.8)
    assert hs["costs"]["h2d_bytes"] == 2500.0  # median of 5000 and 0
    md = peers_report.markdown(rows)
    assert md.splitlines()[0].startswith("| context | arm |") and len(md.splitlines()) == 4
    assert "| HiSparse | n/a | 2.5 | n/a |" in md and "0.938 of 16" in md and "0.65 (0.50-0.80)" in md
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


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--contexts", "9,x"], "--contexts"),
        (["--requests", "0"], "--requests"),
        (["--repeats", "0"], "--repeats"),
        (["--kmax", "0"], "--kmax"),
        (["--hisparse-buffer", "100"], "--hisparse-buffer"),
        (["--hisparse-buffer", "512"], "--hisparse-buffer 512: the HiSparse+prefetch"),
        (["--hisparse-buffer", "640,576"], "--hisparse-buffer"),
        (["--hisparse-buffer", "576,640,768"], "--hisparse-buffer"),
        (["--arms", "hisparse"], "--arms 'hisparse': must include stock"),
        (["--arms", "stock,hs_prefech"], "--arms"),
        (["--steady-tokens", "1"], "--steady-tokens"),
    ],
)
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
        assert pool >= n * (ctx + max_new)  # the full pool holds every request
        assert int(pool * SWA_RATIO) >= n * (max_new + SWA_SLACK)  # and D's SWA pool admits them all
    assert pool_tokens(2304, 2048, 2) > 10240


PREFETCH_BEFORE = (
    METRICS_BEFORE
    + """flashmemory_hisparse_swapin_lookups_total 2000.0
flashmemory_hisparse_swapin_hits_total 1000.0
flashmemory_hisparse_prefetch_calls_total 2.0
flashmemory_hisparse_prefetch_loaded_total 10.0
flashmemory_hisparse_prefetch_bytes_h2d_total 5840.0
flashmemory_hisparse_prefetch_used_total 3.0
"""
)
PREFETCH_AFTER = (
    METRICS_AFTER
    + """flashmemory_hisparse_swapin_lookups_total 10000.0
flashmemory_hisparse_swapin_hits_total 7000.0
flashmemory_hisparse_prefetch_calls_total 26.0
flashmemory_hisparse_prefetch_loaded_total 410.0
flashmemory_hisparse_prefetch_bytes_h2d_total 239440.0
flashmemory_hisparse_prefetch_used_total 103.0
"""
)


def test_prefetch_costs_split_on_demand_from_prefetched_bytes():
    """HiSparse+prefetch: on-demand bytes are the swap-in's (critical path), prefetched ones are counted apart;
    the hit rate is the demand swap-in's hits over its lookups; transfer ops add the prefetch calls."""
    d = delta(parse_metrics(PREFETCH_BEFORE), parse_metrics(PREFETCH_AFTER))
    assert d[HP + "bytes_h2d_total"] == 400 * 584.0 and d[HS + "lookups_total"] == 8000.0
    c = per_token_costs("hs_prefetch@640", d, tokens=16, ctx=4000, shape=SHAPE, knobs=KNOBS)
    assert c["h2d_bytes"] == 1168000 / 16  # the demand misses only
    assert c["prefetch_bytes"] == 400 * 584 / 16  # off the critical path
    assert c["hit_rate"] == 6000 / 8000
    assert c["transfer_ops"] == (32 + 24) / 16 and c["moved_entries"] == (2000 + 400) / 16
    assert c["scored_entries"] == 2 * 1000 + 2 * 1000 / 16  # the native indexer + Level 1 every 16 steps
    # the plain HiSparse arm on the same counters: no prefetch share, same hit-rate rule
    h = per_token_costs("hisparse@640", d, tokens=16, ctx=4000, shape=SHAPE, knobs=KNOBS)
    assert h["prefetch_bytes"] == 0.0 and h["transfer_ops"] == 2.0 and h["hit_rate"] == 0.75
    assert h["scored_entries"] == 2000.0
    assert math.isnan(per_token_costs("hisparse", {}, 16, 4000, SHAPE, KNOBS)["hit_rate"])  # nothing looked up


def test_arm_keys_per_buffer_size():
    assert arm_key("hs_prefetch", 640) == "hs_prefetch@640" and arm_key("stock", 640) == "stock"
    assert arm_key("hisparse", None) == "hisparse"
    assert split_arm("hs_prefetch@576") == ("hs_prefetch", 576) and split_arm("flashmemory") == ("flashmemory", None)
    assert arm_label("hs_prefetch@640") == "HiSparse+prefetch (640)" and arm_label("hisparse") == "HiSparse"
    keys = ["flashmemory", "hs_prefetch@640", "hisparse@640", "stock", "hs_prefetch@576", "hisparse@576"]
    assert sorted(keys, key=arm_order) == [
        "stock",
        "hisparse@576",
        "hisparse@640",
        "hs_prefetch@576",
        "hs_prefetch@640",
        "flashmemory",
    ]
    for bad in ("other", "stock@640"):
        with pytest.raises(ValueError, match="unknown arm"):
            split_arm(bad)
    # device bytes follow the key's buffer size; the prefetch arm holds HiSparse's buffer
    assert device_bytes("hisparse@640", 4000, SHAPE, KNOBS)["reserve"] == 2 * 704 * 584
    assert device_bytes("hs_prefetch@576", 4000, SHAPE, KNOBS) == device_bytes("hisparse@576", 4000, SHAPE, KNOBS)
    assert device_bytes("hs_prefetch", 4000, SHAPE, KNOBS)["reserve"] == 2 * 576 * 584  # knobs.hot_buffer


def test_parse_buffers_and_arms():
    assert parse_buffers("576,640", 512, prefetch=True) == [576, 640]
    assert parse_buffers("512", 512, prefetch=False) == [512]
    with pytest.raises(PeersArgError, match="more slots than"):
        parse_buffers("512,640", 512, prefetch=True)
    assert parse_arms("hs_prefetch,stock") == ["stock", "hs_prefetch"]


def test_prefetch_stacks_one_per_buffer_size():
    """Each hot-buffer arm runs once per size; the prefetch D loads the plugin with the gate and the checkpoint
    (Level 1 as the hint source), plain HiSparse's D loads neither."""
    from flashmemory.bench.peers_live import arm_setups

    setups = arm_setups(
        Path("m"), 11000, 12000, 4, 2, "r.pt", [576, 640], 512, 16, ("stock", "hisparse", "hs_prefetch")
    )
    by = {s.arm: s.cfg for s in setups}
    assert list(by) == ["stock", "hisparse@576", "hisparse@640", "hs_prefetch@576", "hs_prefetch@640"]
    for b in (576, 640):
        hs, pf = by[f"hisparse@{b}"], by[f"hs_prefetch@{b}"]
        assert hs.decode_args == pf.decode_args and f'"device_buffer_size": {b}' in pf.decode_args[-1]
        assert pf.decode_env["SGLANG_FLASHMEMORY_HISPARSE_PREFETCH"] == "1" and pf.decode_env["CKPT"] == "r.pt"
        assert "flashmemory," in pf.decode_env["SGLANG_PLUGINS"] + ","
        assert hs.decode_env["CKPT"] == "" and "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH" not in hs.decode_env
        assert pf.transfer_backend == hs.transfer_backend == "mooncake"
    one = arm_setups(Path("m"), 11000, 12000, 4, 2, "r.pt", [640], 512, 16, ("stock", "hisparse"))
    assert [s.arm for s in one] == ["stock", "hisparse"]  # one size: the bare key, as runs before the sizes


def test_summary_orders_buffer_sizes_and_shows_prefetch_columns():
    costs = {
        "h2d_bytes": 3000.0,
        "prefetch_bytes": 1500.0,
        "hit_rate": 0.8125,
        "transfer_ops": 3.0,
        "moved_entries": 9.0,
        "scored_entries": 2100.0,
    }
    rounds = [
        _rec("hs_prefetch@640", 0, 8.0, 2.0, costs=costs),
        _rec("hisparse@640", 0, 8.0, 2.0),
        _rec("stock", 0, 10.0, 2.0),
        _rec("hs_prefetch@576", 0, 8.0, 2.0),
    ]
    rows = peers_report.summarize(rounds)
    assert [r["arm"] for r in rows] == ["stock", "hisparse@640", "hs_prefetch@576", "hs_prefetch@640"]
    md = peers_report.markdown(rows)
    assert "| 4,000 | HiSparse+prefetch (640) | 0.812 | 3.0 | 1.5 | 3.00 |" in md
    assert "| 4,000 | HiSparse (640) | n/a | 0.0 | n/a |" in md  # a record without the new keys: n/a
