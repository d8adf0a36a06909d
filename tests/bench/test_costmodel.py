"""Cost model: reproduces upstream's per-token GFLOP table from the model functions, moves the right way with
KMAX / context, keeps its byte accounting consistent, and the bench command runs and writes JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flashmemory.bench import costmodel as bench
from flashmemory.cli import main
from flashmemory.costmodel import (
    UPSTREAM,
    UPSTREAM_CONSTANT_GFLOP,
    CountRules,
    FlashShape,
    Hardware,
    HiSparseKnobs,
    PolicyKnobs,
    baseline_bytes,
    baseline_flops,
    constant_terms,
    estimate,
    fit_line,
    flashmemory_bytes,
    flashmemory_flops,
    hisparse_bytes,
    hisparse_swap_tokens,
    kv_budget_per_gpu,
    n_chunks,
    resident_chunks,
    throughput_at,
)
from flashmemory.costmodel.admission import sized
from flashmemory.costmodel.anchors import fit, launch_node
from flashmemory.costmodel.peers import kmax_for, peer_table
from flashmemory.costmodel.projections import auto_ratio_capacity

G = 1e9


@pytest.mark.parametrize("ctx", sorted(UPSTREAM))
def test_matches_upstream_gflop_table_within_5pct(ctx):
    kmax, up_base, up_fm = UPSTREAM[ctx][:3]
    base = baseline_flops(ctx).total / G
    fm = flashmemory_flops(ctx, kmax).total / G
    assert abs(base / up_base - 1) <= 0.05, (ctx, base, up_base)
    assert abs(fm / up_fm - 1) <= 0.05, (ctx, fm, up_fm)
    assert abs((fm / base) - (up_fm / up_base)) <= 0.03


def test_constant_part_matches_upstream_and_is_shared():
    const = baseline_flops(262144).constant / G
    assert abs(const / UPSTREAM_CONSTANT_GFLOP - 1) <= 0.02
    assert flashmemory_flops(1048576, 384).constant == baseline_flops(262144).constant
    # the expert MACs dominate, as in any 13B-active MoE
    experts = next(t for t in constant_terms(FlashShape()) if t.name == "moe experts")
    assert experts.flops(CountRules()) / G > 0.5 * const


def test_kmax_moves_flashmemory_flops_the_right_way():
    ctx = 524288
    small, mid, big = (flashmemory_flops(ctx, k).total for k in (48, 192, 768))
    assert small < mid < big
    assert big < baseline_flops(ctx).total
    # once KMAX*64 covers the history, Level 2 scores the same chunks the baseline does
    full = flashmemory_flops(ctx, n_chunks(ctx) // 64 + 10)
    assert full.scoring == baseline_flops(ctx).scoring
    assert resident_chunks(10**6, ctx) == n_chunks(ctx)


def test_context_moves_baseline_linearly_and_level1_only_for_flashmemory():
    xs = [262144, 524288, 1048576]
    icpt, slope = fit_line(xs, [baseline_flops(c).total for c in xs])
    assert icpt == pytest.approx(baseline_flops(4).constant, rel=1e-3)
    assert slope == pytest.approx(2 * (64 * 128 + 64) * 21 / 4, rel=1e-6)
    assert baseline_flops(xs[0]).level1 == 0
    with_l1, without = flashmemory_flops(xs[0], 96), flashmemory_flops(xs[0], 96, rules=CountRules(count_level1=False))
    assert with_l1.total > without.total and without.level1 == 0


def test_counting_rules_change_the_answer():
    # 1 FLOP per MAC halves everything: the table cannot be matched that way
    half = baseline_flops(262144, rules=CountRules(flops_per_mac=1)).total
    assert half == pytest.approx(baseline_flops(262144).total / 2)
    core = flashmemory_flops(262144, 96, rules=CountRules(count_attention_core=True))
    assert core.attention_core > 0 and core.total > flashmemory_flops(262144, 96).total


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="kmax"):
        flashmemory_flops(262144, 0)
    with pytest.raises(ValueError, match="ctx"):
        n_chunks(-1)
    with pytest.raises(ValueError, match="mem_fraction"):
        Hardware(mem_fraction=1.5)
    with pytest.raises(ValueError, match="fit_line"):
        fit_line([1.0], [2.0])


def test_byte_model_is_consistent():
    ctx, kmax = 1048576, 384
    b = baseline_bytes(ctx)
    assert b.device_parts["c4 kv"] == 21 * (ctx // 4) * 584
    assert b.device_parts["index keys"] == 21 * (ctx // 4) * 132
    assert b.device_parts["c128 kv"] == 20 * (ctx // 128) * 584
    assert b.device_parts["swa kv"] == 43 * 128 * 584
    f = flashmemory_bytes(ctx, kmax, PolicyKnobs(path_i=True))
    f_no = flashmemory_bytes(ctx, kmax, PolicyKnobs(path_i=False))
    assert f.device < f_no.device < b.device
    assert f.host > f_no.host == b.device_parts["c4 kv"]
    # Level 2 reads far fewer index keys than the baseline; HiSparse reads as much as the baseline
    assert f.hbm_read_step < 0.3 * b.hbm_read_step
    h = hisparse_bytes(ctx, HiSparseKnobs(hit_rate=0.9))
    assert h.hbm_read_step == b.hbm_read_step
    assert h.pcie_step > hisparse_bytes(ctx, HiSparseKnobs(hit_rate=1.0)).pcie_step
    assert flashmemory_bytes(ctx, kmax, PolicyKnobs(turnover=0.5)).recall_cycle == pytest.approx(f_no.recall_cycle / 2)
    assert flashmemory_bytes(ctx, 2 * kmax).device > f_no.device


def test_estimate_orders_policies():
    hw = Hardware(overhead_ms=20.0)
    for ctx, (kmax, *_rest) in UPSTREAM.items():
        kn = PolicyKnobs(path_i=ctx >= 1048576)
        base = estimate(baseline_bytes(ctx), baseline_flops(ctx).total, hw)
        fm = estimate(flashmemory_bytes(ctx, kmax, kn), flashmemory_flops(ctx, kmax).total, hw)
        assert fm.conc > base.conc and fm.tok_s > base.tok_s
    # more HBM -> higher baseline ceiling
    assert (
        estimate(baseline_bytes(524288), 1e11, Hardware(hbm_gb=141)).conc
        > estimate(baseline_bytes(524288), 1e11, Hardware()).conc
    )


def test_bench_runs_and_writes_json(tmp_path, capsys):
    import argparse

    p = argparse.ArgumentParser()
    bench.add_args(p)
    out = tmp_path / "cm.json"
    assert bench.run(p.parse_args(["--quick", "--json", str(out)])) == 0
    text = capsys.readouterr().out
    assert "ANCHORS" in text and "upstream" in text
    data = json.loads(out.read_text())
    assert set(data) == {"anchors", "projections", "flops", "assumptions", "bytes", "peers", "disk"}
    assert len(data["flops"]["cases"]) == 3
    assert "PROJECTED stock vs HiSparse vs FlashMemory" in text and "PROJECTED (calibrated model" in text
    assert len(data["peers"]["cells"]) == 9
    assert bench.run(p.parse_args(["--contexts", "1024"])) == 2
    assert bench.run(p.parse_args(["--hisparse-buffer", "100"])) == 2
    err = capsys.readouterr().err
    assert "flashmemory bench costmodel: error: --contexts entry '1024'" in err
    assert "flashmemory bench costmodel: error: --hisparse-buffer 100" in err


def test_hisparse_bytes_by_hand():
    # 128K: 32768 c4 entries; sglang's default hot buffer 4096 + one 64-entry page per c4 layer
    h = hisparse_bytes(131072)
    assert h.device_parts == {
        "c4 hot buffer": 21 * 4160 * 584,
        "index keys": 21 * 32768 * 132,
        "c128 kv": 20 * 1024 * 584,
        "swa kv": 43 * 128 * 584,
    }
    assert h.device == 51_018_240 + 90_832_896 + 11_960_320 + 3_214_336 == 157_025_792
    assert h.host == 21 * 32768 * 584 == 401_866_752
    # swap-in: 5% of 512 picks x 21 layers x 584 B; backup: one 584-B entry per layer every 4 steps
    assert h.pcie_step == pytest.approx(0.05 * 512 * 21 * 584 + 21 * 584 / 4) == 313_958.4 + 3066
    assert h.hbm_read_step == 90_832_896 + 21 * 512 * 584 + 11_960_320 + 3_214_336
    assert h.recall_cycle == pytest.approx(313_958.4 * 64)
    # the native indexer still reads every index key: the same HBM read as stock, a fraction of stock's device bytes
    assert h.hbm_read_step == baseline_bytes(131072).hbm_read_step
    assert hisparse_swap_tokens(1048576, HiSparseKnobs(hit_rate=0.9)) == pytest.approx(0.1 * 512 * 21)
    # fast path: a history that fits the buffer swaps nothing in (4096 entries = 16K tokens), one more does
    assert hisparse_swap_tokens(16384) == 0 and hisparse_swap_tokens(16388) > 0
    assert hisparse_bytes(16384).pcie_step == 21 * 584 / 4
    # the buffer is allocated whole whatever the history
    assert hisparse_bytes(4096).device_parts["c4 hot buffer"] == 21 * 4160 * 584
    with pytest.raises(ValueError, match="device_buffer_size 256 < index_topk 512"):
        hisparse_bytes(131072, HiSparseKnobs(device_buffer_size=256))
    with pytest.raises(ValueError, match="hit_rate"):
        HiSparseKnobs(hit_rate=1.5)


def test_throughput_at_fits_or_says_none():
    hw = Hardware()
    b = baseline_bytes(262144)
    cap = int(kv_budget_per_gpu(hw) // b.device)
    assert cap == 56
    tok, ms = throughput_at(b, baseline_flops(262144).total, hw, cap)
    assert tok == pytest.approx(cap / (ms / 1e3))
    assert throughput_at(b, baseline_flops(262144).total, hw, cap + 1) is None
    # a HiSparse step costs at least its synchronous swap-in on top of stock's step
    hs = hisparse_bytes(262144)
    t_stock = throughput_at(b, baseline_flops(262144).total, hw, 16)[1]
    t_hs = throughput_at(hs, baseline_flops(262144).total, hw, 16, sync_pcie=True)[1]
    assert t_hs >= t_stock + 16 * hs.pcie_step / 50e9 * 1e3 - 1e-9
    with pytest.raises(ValueError, match="batch"):
        throughput_at(b, 1.0, hw, 0)


def test_peer_table_by_hand():
    assert [kmax_for(c) for c in (131072, 262144, 1048576)] == [48, 96, 384]
    f = fit()
    cells = {(c.policy, c.ctx): c for c in peer_table(f)}
    stock = cells["stock", 131072]
    # what one request occupies (every region on the device) ...
    assert stock.device_bytes == 21 * 32768 * (584 + 132) + 20 * 1024 * 584 + 43 * 128 * 584 == 507_874_304
    # ... and what sglang's token pool admits: the whole context + 1,024 reserved decode tokens at 3,899.25 B per
    # full token plus the chosen SWA ratio's share (this repo's launch: FP8 experts, sglang's memory fraction)
    p = launch_node(f)
    ratio, n, _ = auto_ratio_capacity(p, "stock", 131072)
    pools = sized(dataclasses.replace(p, serving=dataclasses.replace(p.serving, swa_ratio=ratio)))
    assert stock.max_conc == pools.full_tokens // (131072 + 1024) == n == 101 and stock.bound == "token pool"
    assert cells["stock", 262144].tok_s[64] is None and cells["stock", 262144].tok_s[16] is not None
    # HiSparse at 1M is held by its token pool, not by host DRAM
    hs1m = cells["hisparse", 1048576]
    assert (hs1m.max_conc, hs1m.bound) == (21, "token pool")
    for ctx in (131072, 262144, 1048576):
        assert cells["hisparse", ctx].device_bytes < cells["stock", ctx].device_bytes
        assert cells["hisparse", ctx].device_parts["index keys"] == cells["stock", ctx].device_parts["index keys"]
        assert cells["hisparse", ctx].max_conc >= cells["stock", ctx].max_conc
        for b in (1, 16):  # the synchronous swap-in kernel makes HiSparse slower at the same batch
            if cells["stock", ctx].tok_s[b] is not None:
                assert cells["hisparse", ctx].tok_s[b] < cells["stock", ctx].tok_s[b]


@pytest.mark.parametrize(
    "flags, msg",
    [
        (["--weights-gb", "5000"], "no HBM left for KV: 102.625 GB (--hbm-gb) x memory fraction 0.895"),
        (["--hbm-gb", "5"], "no HBM left for KV: 5 GB (--hbm-gb)"),
        (["--mem-fraction", "0.2"], "memory fraction 0.200 (--mem-fraction)"),
        (["--hbm-gb", "1e300"], "--hbm-gb 1e+300: must lie in [0.001, 10000]"),
        (["--host-ram-gb", "1e300"], "--host-ram-gb 1e+300: must lie in"),
    ],
)
def test_node_without_kv_room_is_one_line(flags, msg, capsys):
    assert main(["bench", "costmodel", "--anchors", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == err.splitlines()[0] and msg in err and "Traceback" not in err
